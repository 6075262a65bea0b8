"""The recipe's sections as pydantic models, on a floor below the backends and workers that read them.

A backend, a worker and a loop take the section itself (`TrainingSection`, `GenerationSection`, ...), so
each knob has one definition and one default, here. A field whose check needs a registry (a backend, refit
transport or tool-call format name) is a plain `str` here; `gymv.config.schema` subclasses those sections
with the check and composes the recipe from them. Every section is closed (`extra="forbid"`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gymv.cluster_limits import ADDRESS_FIX, MAX_NODES, address_problem, has_control_or_space

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
MAX_RESTARTS = 100  # cluster.max_restarts, gymv train --max-restarts
# a sequence's multiplicative logprob error is >= 1, so a threshold below 1 would mask every sequence
SeqErrorThreshold = Annotated[float, Field(ge=1)] | None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)  # lr=inf is no learning rate


class ModelSection(Section):
    path: str = "embedded:tiny-llava"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_seq_len: PosInt = 2048
    trust_remote_code: bool = False


class VisionSection(Section):
    max_image_pixels: PosInt = 1024 * 1024
    max_images_per_sample: PosInt = 8
    dedup_payloads: bool = True


class PrepareSection(Section):
    n_train: PosInt = 256
    n_eval: NonNegInt = 64
    preset: str | None = None
    knobs: dict[str, Any] = {}
    seed: int = 0


class DataSection(Section):
    train: str | list[str] | None = None
    eval: str | list[str] | None = None
    prepare: PrepareSection | None = PrepareSection()
    shuffle: bool = True


class EnvSection(Section):
    name: str = "circle-count"
    preset: str | None = None
    url: str | None = None
    max_turns: PosInt = 1
    max_rollout_tokens: PosInt = 2048
    timeout_s: PosFloat = 30.0
    retries: NonNegInt = 2
    max_failed_fraction: Annotated[float, Field(ge=0, le=1)] = 0.5  # of one step's rollouts, else the run stops
    failed_window_steps: PosInt = 10
    max_failed_fraction_window: Annotated[float, Field(ge=0, le=1)] = 0.25  # over the last failed_window_steps
    kwargs: dict[str, Any] = {}


class RolloutSection(Section):
    """Who runs episodes: gymv's own agent loop, or NeMo Gym agent servers calling gymv's model server."""

    driver: Literal["gymv", "nemo_gym_agents"] = "gymv"
    agents: dict[str, str] = {}  # agent_ref.name -> the agent server's URL
    model_server_host: str = "127.0.0.1"
    model_server_port: NonNegInt = 0  # where the agents were told the policy model is
    agent_timeout_s: PosFloat = 600.0
    tool_call_format: str = "hermes"  # how the model writes tool calls (gymv.rollout.tool_formats)
    turns: Literal["auto", "streamed", "synchronous"] = "auto"  # how gymv's loop batches turns (docs/rollout.md)

    @model_validator(mode="after")
    def _agents_given(self) -> "RolloutSection":
        if self.driver == "nemo_gym_agents" and (not self.agents or not self.model_server_port):
            raise ValueError("driver nemo_gym_agents needs rollout.agents (agent name -> URL) and "
                             "rollout.model_server_port (the port the agents call the policy model on)")
        return self


class VllmSection(Section):
    gpu_memory_utilization: Fraction = 0.6
    tensor_parallel_size: PosInt = 1
    enforce_eager: bool = False
    # more arguments of vLLM's engine (vllm.LLM), as they are (NeMo RL's policy.generation.vllm_kwargs); those gymv
    # sets itself are refused (rule vllm.engine-kwargs)
    engine_kwargs: dict[str, Any] = {}


class GenerationSection(Section):
    backend: str = "hf"  # a registered generation backend (gymv.backends.registry)
    decode: Literal["auto", "eager", "static"] = "auto"  # the hf backend's decode loop
    max_batch: PosInt = 256  # sequences the static decoder runs at once; the rest wait for a free slot
    temperature: NonNegFloat = 1.0
    top_p: Fraction = 1.0
    max_new_tokens: PosInt = 64
    stop_strings: list[str] = []
    chat_template_kwargs: dict[str, Any] = {}  # the chat template's own variables, e.g. {enable_thinking: false}
    reset_encoder_cache_after_weight_update: bool = False
    vllm: VllmSection = VllmSection()

class ParallelSection(Section):
    tensor: PosInt = 1
    pipeline: PosInt = 1
    context: PosInt = 1
    expert: PosInt = 1


class FsdpSection(Section):
    """Read by training.backend fsdp2 (gymv.backends.training.fsdp)."""

    cpu_offload: bool = False  # sharded weights, gradients and optimizer state in host memory (CUDA only)
    reshard_after_forward: bool = True  # free each layer's gathered weights after its forward
    # one rank: reduce gradients once per step (accumulated unsharded in float32) instead of after every
    # micro-batch; auto: where those gradients take at most a tenth of the GPU's memory (docs/training.md)
    defer_gradient_reduction: bool | Literal["auto"] = "auto"


class MoeSection(Section):
    """Mixture-of-experts routers (Nemotron 3 Omni): their load-balancing terms (gymv.backends.moe_router)."""

    aux_loss_coef: NonNegFloat = 0.0  # weight of the load-balancing loss in the training loss (logged either way)
    router_bias_update_rate: NonNegFloat = 0.0  # aux-loss-free expert-bias update per step (0: the bias is frozen)
    freeze_router: bool = False  # the routers' weights stay as loaded (NeMo RL's freeze_moe_router); the bias update runs

    @model_validator(mode="after")
    def _aux_reaches_the_router(self) -> "MoeSection":
        if self.freeze_router and self.aux_loss_coef > 0:
            raise ValueError("aux_loss_coef > 0 with freeze_router: the balancing loss's gradient reaches only the "
                             "routers' weights, which freeze_router keeps fixed; set aux_loss_coef: 0 or "
                             "freeze_router: false")
        return self


class TrainingSection(Section):
    backend: str = "torch"  # a registered training backend (gymv.backends.registry)
    lr: PosFloat = 1e-6
    warmup_steps: NonNegInt = 0
    warmup_init_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0  # where the warm-up starts, as a fraction of lr
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after the warm-up
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0  # where linear/cosine end, as a fraction of lr
    weight_decay: NonNegFloat = 0.0
    # AdamW's moments: float32, or bfloat16 with stochastic rounding (half their memory; docs/training.md)
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    betas: Annotated[list[float], Field(min_length=2, max_length=2)] = [0.9, 0.999]
    eps: PosFloat = 1e-8
    max_grad_norm: PosFloat | None = 1.0
    global_batch_size: PosInt | None = None  # null: the samples of one step (filled in on validation)
    micro_batch_tokens: PosInt = 4096
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    gradient_checkpointing: bool = False
    # with gradient_checkpointing: the vision tower's blocks recomputed too; false keeps their activations (a few
    # GB a step of pictures) and skips the tower's recomputation (docs/training.md)
    vision_checkpointing: bool = True
    # torch backend in bfloat16: the language model's matrices cast once a step into a working copy (2 bytes a
    # weight held for the step) instead of at every use; false: autocast's casts (docs/training.md)
    weight_copy: bool = False
    sequence_packing: bool | Literal["auto"] = "auto"  # micro-batches as packed rows (docs/training.md)
    # torch.compile each decoder layer (torch and fsdp2 backends; docs/training.md); a name picks torch.compile's
    # backend (true: inductor)
    compile: bool | Literal["inductor", "aot_eager"] = False
    parallel: ParallelSection = ParallelSection()
    fsdp: FsdpSection = FsdpSection()
    moe: MoeSection = MoeSection()

class RefitCheckSection(Section):
    """How each engine proves it holds the trainer's weights after a refit (gymv.cluster.refit_check)."""

    # auto: the generation backend's own check (hf: digest, vllm: probe); digest, probe; off: none
    mode: Literal["auto", "digest", "probe", "off"] = "auto"
    first: NonNegInt = 3  # refits checked one by one from the start (the engines' initial weights count as 0)
    every: NonNegInt = 10  # then every Nth refit (0: none after the first)
    probe_tokens: Annotated[int, Field(ge=4, le=4096)] = 32  # text tokens of the probe sequence
    probe_tolerance: PosFloat | None = None  # mean |engine - trainer| logprob per token; null: by model.dtype

    @field_validator("mode", mode="before")
    @classmethod
    def _off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false


class RefitSection(Section):
    transport: str = "object_store"
    # MiB per bucket that object_store and nccl ship while the next fills (0: the whole buffer at once)
    bucket_mb: NonNegFloat = 256.0
    check: RefitCheckSection = RefitCheckSection()

RayStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"  # Ray's label name and value syntax
_LABEL_KEY = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*/)?{_LABEL}")
_LABEL_SELECTOR = re.compile(rf"!?(?:in\({_LABEL}(?:, ?{_LABEL})*\)|{_LABEL})")


class RolePlacement(Section):
    """Where one role's workers may go (docs/cluster.md): a Ray placement-group strategy and node pins."""

    strategy: RayStrategy | None = None  # None: PACK on GPUs, SPREAD for a CPU run's training ranks
    labels: dict[str, str] = {}  # Ray node labels every worker's node must carry ("v", "!v", "in(a,b)", "!in(a,b)")
    resources: dict[str, PosFloat] = {}  # custom Ray resources each worker (on GPUs: each bundle) reserves

    @field_validator("resources")
    @classmethod
    def _resource_names(cls, v: dict[str, float]) -> dict[str, float]:
        for name in v:
            if not name or has_control_or_space(name):
                raise ValueError(f"{name!r} is no Ray resource name (a non-empty word of printable characters, as "
                                 "`ray start --resources` gave it)")
        return v

    @field_validator("labels")
    @classmethod
    def _selectors(cls, v: dict[str, str]) -> dict[str, str]:
        for key, selector in v.items():
            if not _LABEL_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is no Ray node label name (letters, digits, '-', '_', '.'; an optional "
                                 "'prefix/')")
            if not _LABEL_SELECTOR.fullmatch(selector):
                raise ValueError(f"{selector!r} is no Ray label selector for {key!r}: write v, !v, in(a,b) or !in(a,b)")
        return v


class PlacementSection(Section):
    generation: RolePlacement = RolePlacement()
    training: RolePlacement = RolePlacement()
    teachers: RolePlacement = RolePlacement()  # MOPD teachers with placement: separate


class ClusterSection(Section):
    num_nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1  # MAX_NODES: gymv.cluster_limits says why
    gpus_per_node: NonNegInt = 0
    colocated: bool = True
    generation_gpus: NonNegInt | None = None
    training_gpus: NonNegInt | None = None
    # generation processes per generation GPU (on a CPU: in all); the HF backend's host work (rendering,
    # tokenizing, env calls) is single-process Python, so a GPU that one process cannot keep busy takes more
    generation_workers_per_gpu: PosInt = 1
    # training ranks of a CPU run (gpus_per_node: 0), one Ray actor each, spread over num_nodes Ray nodes
    cpu_training_ranks: PosInt = 1
    ray_address: str | None = None  # HOST:PORT or auto
    placement: PlacementSection = PlacementSection()
    # deadlines of the waits on Ray: joining ray_address (reaching its GCS, the handshake), placement groups
    # (and a launcher's nodes joining), workers starting, one phase
    connect_timeout_s: PosFloat = 60.0
    placement_timeout_s: PosFloat = 300.0
    start_timeout_s: PosFloat = 1800.0
    phase_timeout_s: PosFloat = 3600.0
    # resumes from the newest complete checkpoint after a lost node or worker; a bound so that a typo is no loop
    max_restarts: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = 0

    @field_validator("ray_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        problem = None if v is None else address_problem(v)
        if problem:
            raise ValueError(f"{problem}: {ADDRESS_FIX}")
        return v


class CheckpointSection(Section):
    dir: str = "runs"
    # false: no checkpoint is written (a throwaway run or a benchmark whose state the disk cannot hold); a
    # crash or a restart then begins again at step 1, and the final model is still exported
    enabled: bool = True
    period: PosInt = 10
    keep: PosInt = 2
    resume: bool = True
    steps_per_run: PosInt | None = None

    @model_validator(mode="after")
    def _stops_at_a_checkpoint(self) -> "CheckpointSection":
        if not self.enabled and self.steps_per_run is not None:
            raise ValueError("steps_per_run stops a run at a checkpoint for the next run to resume from, and "
                             "enabled: false writes none; set enabled: true or drop steps_per_run")
        return self


class LoggerSection(Section):
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    plugins: list[str] = []  # logger plugins (entry-point group gymv.loggers) to log to as well
    log_rollouts: bool = True


class ImportanceSampling(Section):
    kind: Literal["none", "truncated", "icepop", "seq_mask_tis"] = "none"
    truncate_max: Annotated[float, Field(ge=1)] | None = 2.0  # null: no cap (NeMo RL's correction with no type)
    truncate_min: Annotated[float, Field(ge=0, lt=1)] = 0.0
    gate_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    gate_high: Annotated[float, Field(gt=1)] = 5.0


class AsyncSection(Section):
    enabled: bool = False
    max_trajectory_age_steps: NonNegInt = 1
    in_flight_weight_updates: bool = False


class LogprobErrorGuard(Section):
    """The run-level watch on `train/token_mult_prob_error` (gymv.train.logprob_guard)."""

    max_median: Annotated[float, Field(ge=1)] | None = 1.05  # NeMo RL's nightly bound; null: not watched
    window_steps: PosInt = 10  # the median is over this many latest steps
    stop: bool = False  # stop the run (after logging and checkpointing the step) instead of warning


class TeacherSection(Section):
    path: str
    backend: str = "torch"  # a registered teacher backend (gymv.backends.registry)
    data_parallel_size: PosInt = 1
    # GPUs one replica spans (vllm, megatron), and how its MoE experts are split over them (rule teacher.parallel)
    tensor_parallel_size: PosInt = 1
    expert_parallel_size: PosInt = 1
    placement: Literal["colocated", "separate"] = "colocated"
    gpus: NonNegInt | None = None
    engine_kwargs: dict[str, Any] = {}  # vllm: more arguments of its engine, as generation.vllm.engine_kwargs


def default(section: type[Section], key: str) -> Any:
    """The default of `section`'s field `key`: what an interface below the recipe (a backend's keyword, a
    per-call type) offers as its own default, so that a knob has one default, its section's."""
    return section.model_fields[key].default
