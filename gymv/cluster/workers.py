"""The Ray actors of a run: generation workers (a generation backend + environments + the agent loop) and
training workers (one rank of a training backend each). Backends come from gymv.backends.registry by the
names in the spec, and are driven through their interfaces only.

The classes are plain Python; `gymv.cluster.group` wraps them with `ray.remote` and places them, and tests
may also build them in-process. Every method is one phase of a step, so the driver makes one Ray round
trip per phase. On CPU each actor takes all of the machine's threads: the phases of a synchronous step
alternate, so generation and training never compete for them.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gymv.algorithms.seq_error import drop_masked_samples
from gymv.backends.generation import GenerationBackend, SamplingParams
from gymv.backends.registry import GENERATION_BACKENDS, TRAINING_BACKENDS
from gymv.backends.training.base import TrainingSetup
from gymv.backends.training.process_group import leave_process_group
from gymv.backends.training.samples import as_tensors, training_sample
from gymv.cluster.device_memory import phase_memory
from gymv.cluster.prefetch import Prefetch
from gymv.cluster.ray_placement import here
from gymv.cluster.refit import make_receiver, make_sender
from gymv.backends.weights import Digests, weight_digests
from gymv.cluster.refit_check import (
    CheckRequest,
    Probe,
    build_probe,
    check_refit,
    engine_account,
    trainer_probe,
)
from gymv.envs.routing import EnvRouter
from gymv.errors import GymvError
from gymv.io import as_write_failure, follow_umask
from gymv.net import master_store
from gymv.registry import import_object
from gymv.rollout import ImageCache, build_sft_sample, run_rollouts
from gymv.rollout.agent_driver import run_agent_rollouts
from gymv.rollout.policy_server import PolicyServer
from gymv.runs.checkpoint import capture_rng_state, restore_rng_state
from gymv.sections import (
    EnvSection,
    GenerationSection,
    ModelSection,
    RefitSection,
    RolloutSection,
    TrainingSection,
    VisionSection,
)
from gymv.timing import PhaseTimer


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds itself from, pickled into each actor: the recipe's sections as they are, and the
    facts of this run around them (where the weights are, the device, which extras a loop asks for)."""

    model_path: str  # model.path, resolved to a local folder
    env: EnvSection
    model: ModelSection = field(default_factory=ModelSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    refit: RefitSection = field(default_factory=RefitSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    vision: VisionSection | None = None
    seed: int = 0
    device: str = "cpu"
    generation_dtype: str = "float32"  # model.dtype, auto resolved (gymv.train.setup.generation_dtype)
    logprob_temperature: float | None = None  # the trainer's logprobs' temperature; None: generation.temperature
    total_steps: int = 0  # optimizer steps of the whole run (the schedule's end)
    kl_reference: bool = False
    threads: int | None = None
    shares_gpu: bool = False  # generation and training on one GPU: each hands its cached memory back after a step

    def located(self) -> WorkerSpec:
        """This spec with backend names turned into import paths that resolve in any process (a backend
        registered in the driver's process only is then found by its Ray workers too)."""
        return replace(self, generation=self.generation.model_copy(
                           update={"backend": GENERATION_BACKENDS.locate(self.generation.backend)}),
                       training=self.training.model_copy(
                           update={"backend": TRAINING_BACKENDS.locate(self.training.backend)}))

    @property
    def max_image_pixels(self) -> int | None:
        return self.vision.max_image_pixels if self.vision is not None else None

    @property
    def max_images(self) -> int | None:
        return self.vision.max_images_per_sample if self.vision is not None else None

    @property
    def agents(self) -> dict[str, str]:
        """rollout.agents when NeMo Gym agent servers drive the episodes, else none (gymv's own loop)."""
        return dict(self.rollout.agents) if self.rollout.driver == "nemo_gym_agents" else {}

    def training_setup(self) -> TrainingSetup:
        g = self.generation
        return TrainingSetup(model_path=self.model_path, training=self.training, device=self.device, seed=self.seed,
                             temperature=g.temperature if self.logprob_temperature is None else self.logprob_temperature,
                             total_steps=self.total_steps, kl_reference=self.kl_reference,
                             trust_remote_code=self.model.trust_remote_code)

    def build_generation(self, *, device: str, seed: int) -> GenerationBackend:
        """The generation backend of generation.backend, built through the registry's create() contract: every
        backend gets the checkpoint, device, dtype and seed (and trust_remote_code, only when the model asks for
        it); one whose entry declares that it reads generation.vllm (`reads_vllm_section`) also gets that section
        itself and `full_logits`, set where top_p < 1 (the engine then returns every logit and gymv computes the
        logprobs before the nucleus cut, as the trainer does)."""
        g = self.generation
        backend_cls = GENERATION_BACKENDS.load(g.backend)  # a name, or located
        remote = {"trust_remote_code": True} if self.model.trust_remote_code else {}
        if GENERATION_BACKENDS.capabilities(g.backend).reads_vllm_section:
            return backend_cls.create(self.model_path, device=device, dtype=self.generation_dtype, seed=seed,
                                      vllm=g.vllm, full_logits=g.top_p < 1.0, **remote)
        return backend_cls.create(self.model_path, device=device, dtype=self.generation_dtype, seed=seed, **remote)


@dataclass(frozen=True)
class RolloutRequest:
    """What one call for rollouts carries: what changes from call to call. The episode's budgets (turns,
    tokens, sequence length, images), the chat template's variables, the tool-call format and how turns are
    batched are the run's, read by the worker from the sections of its WorkerSpec."""

    group_size: int  # episodes of each row
    params: SamplingParams  # the step's sampling (validation: greedy)
    seed: int | None = None  # the call's sampling seed (None: params.seed)
    source: str | None = None  # the rows' file, for "FILE line N" in errors

    def split(self, worker: int) -> RolloutRequest:
        """This request as worker `worker`'s share of a batch: its own seed, so shares do not sample alike."""
        return replace(self, seed=None if self.seed is None else self.seed + 104729 * worker)


STREAMED = {"auto": None, "streamed": True, "synchronous": False}  # rollout.turns -> run_rollouts' `streamed`


def _set_threads(threads: int | None) -> None:
    import torch

    n = threads or _cpu_count()
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _device(spec: WorkerSpec):
    import torch

    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise GymvError("the recipe asks for GPUs but this worker sees none", where="cluster.gpus_per_node",
                            fix="set cluster.gpus_per_node: 0 to run on CPU")
        torch.cuda.set_device(0)  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
        return torch.device("cuda", 0)
    return torch.device("cpu")


# -------------------------------------------------------------------------------------------- generation


class GenerationWorker:
    """Hosts a generation backend, the environments and the agent loop; receives refits."""

    def __init__(self, spec: WorkerSpec, index: int = 0):
        _set_threads(spec.threads)
        self.spec, self.index = spec, index
        self.device = _device(spec)
        g = spec.generation
        self.backend = spec.build_generation(device=str(self.device), seed=spec.seed + 7919 * index)
        decoder = GENERATION_BACKENDS.capabilities(g.backend).decoder  # the decode loop its entry declares
        if decoder:  # hf's static decoder (and its Triton kernels) loads in the workers that decode with it only
            self.backend = import_object(decoder)(self.backend, g.decode, seed=spec.seed + 7919 * index,
                                                  max_batch=g.max_batch)
        self.router = EnvRouter(spec.env)
        self.receiver = None
        self._last_probe: tuple | None = None  # (refit, trainer's, this engine's account) of the last probe check
        self.weights_version = 0
        self.episodes = 0  # episodes this worker has run
        # Held while generating and while loading weights: an in-flight refit (its own Ray concurrency
        # group) lands between two generate calls, never inside one.
        self._weights_lock = threading.Lock()

    # -- rollouts ------------------------------------------------------------------------------------
    def rollouts(self, rows: Sequence[tuple[int, dict]], request: RolloutRequest) -> dict:
        """Run the agent loop on `rows` (`request.group_size` episodes each), within the run's budgets."""
        t0, started = time.perf_counter(), time.time()
        b, spec = self.backend, self.spec
        stats: dict = {}
        version = self.weights_version
        cache_before = self.backend.stats()
        if spec.agents:
            trajectories = run_agent_rollouts(self._policy_server(request.params), spec.agents, list(rows),
                                              group_size=request.group_size, params=request.params, seed=request.seed,
                                              weights_version=version, timeout_s=spec.rollout.agent_timeout_s,
                                              stats=stats)
        else:
            trajectories = run_rollouts(
                _Locked(self.backend, self._weights_lock), b.adapter, b.tokenizer, b.chat_template, self.router,
                list(rows), group_size=request.group_size, params=request.params, seed=request.seed,
                source=request.source, weights_version=version, stats=stats, max_turns=spec.env.max_turns,
                max_rollout_tokens=spec.env.max_rollout_tokens, max_seq_len=spec.model.max_seq_len,
                max_images=spec.max_images, max_image_pixels=spec.max_image_pixels,
                chat_template_kwargs=dict(spec.generation.chat_template_kwargs) or None,
                tool_call_format=spec.rollout.tool_call_format, streamed=STREAMED[spec.rollout.turns])
        cache_after = self.backend.stats()
        stats.update(phase_memory(self.device, "generation", release=spec.shares_gpu))  # the trainer's turn is next
        self.episodes += len(trajectories)
        stale = "encoder_cache_stale_hits"
        stats[stale] = cache_after.get(stale, 0) - cache_before.get(stale, 0)
        return {"trajectories": trajectories, "seconds": time.perf_counter() - t0, "stats": stats,
                "weights_version": version, "last_weights_version": self.weights_version,
                "started_at": started, "ended_at": time.time()}

    def _policy_server(self, params):
        """The model server the NeMo Gym agents call, started on first use and kept for the run."""
        if getattr(self, "_server", None) is None:
            spec = self.spec
            self._server = PolicyServer(_Locked(self.backend, self._weights_lock), params=params,
                                        max_seq_len=spec.model.max_seq_len, host=spec.rollout.model_server_host,
                                        port=spec.rollout.model_server_port, max_image_pixels=spec.max_image_pixels,
                                        chat_template_kwargs=dict(spec.generation.chat_template_kwargs) or None,
                                        tool_call_format=spec.rollout.tool_call_format).start()
        return self._server

    def pid(self) -> int:
        return os.getpid()

    def where(self) -> dict:
        return here()

    # -- refit ---------------------------------------------------------------------------------------
    def refit_connect(self, info: dict | None, rank: int, transport: str) -> None:
        """Receive refits over `transport` (the run's, chosen from the placement by the driver)."""
        self.receiver = make_receiver(transport, self.device, info, rank)
        self.receiver.connect()

    def receive(self, payload, version: int, *shares) -> dict:
        """Load the published weights (`payload`, with the `shares` of other sending ranks where several
        send); reset the encoder cache only after they loaded (when configured)."""
        t0 = time.perf_counter()
        if self.receiver is None:  # a worker used without a driver (the recipe's transport, in-band)
            self.refit_connect(None, 1 + self.index, self.spec.refit.transport)
        weights = self.receiver.receive([payload, *shares] if shares else payload)
        self._load(weights, version)
        return {"seconds": time.perf_counter() - t0}

    def restore(self, weights: dict, version: int) -> None:
        """Load a CPU copy of the trainer's weights (a replacement worker catching up, outside the transport)."""
        self._load(weights, version)

    def _load(self, weights, version: int) -> None:
        """Load the weights (the backend loads all or nothing); reset the encoder cache only after they
        loaded (when configured)."""
        with self._weights_lock:
            self.backend.update_weights(weights)
            del weights
            self.weights_version = version
            if self.spec.generation.reset_encoder_cache_after_weight_update:
                self.backend.reset_encoder_cache()

    def verify_weights(self, check: CheckRequest, trainer: dict | None) -> None:
        """Check that this engine holds the weights the trainer accounted for in `trainer` (its digests or probe
        logprobs; None: its publish failed, which the refit itself reports): queued right behind the refit's
        `receive` (or, for `check.refit` 0, the engine's initial weights), so nothing loads in between. A
        mismatch is one line naming what differs."""
        if trainer is None:
            return
        with self._weights_lock:
            account = engine_account(self.backend, check, trainer.get("digests") or {}, self.spec.generation_dtype)
        previous, self._last_probe = self._last_probe, (check.version, trainer, account) if check.kind == "probe" else None
        check_refit(check, trainer, account, worker=f"generation worker {self.index}", previous=previous)

    def weights_hash(self) -> str:
        return self.backend.weights_hash()

    def stats(self) -> dict:
        return {**self.backend.stats(), "weights_version": self.weights_version, "episodes": self.episodes}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.backend.close()


class _Locked:
    """The backend, with each generate call (each serve session, all of it) holding the weights lock."""

    def __init__(self, backend, lock):
        self.backend, self.lock = backend, lock

    def generate(self, requests, params):
        with self.lock:
            return self.backend.generate(requests, params)

    def serve(self, feed, params, on_output, **hints):
        with self.lock:
            return self.backend.serve(feed, params, on_output, **hints)

    def __getattr__(self, name):
        return getattr(self.backend, name)


# ---------------------------------------------------------------------------------------------- training


def held_for_first_refit(weights, dtype) -> dict:
    """A gathering trainer's weights held for its first refit: floating tensors in the generation dtype, the
    others (integer buffers such as RADIO's `summary_idxs`) as they are, which is how an ungathered trainer
    streams them and how the engine holds them, so a digest check compares like with like."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights}


def _digesting(weights, dtype, digests):
    """The (name, tensor) pairs of `weights`, each one's digest in `dtype` added to `digests` as it passes."""
    pairs = weights.items() if isinstance(weights, dict) else weights
    for name, t in pairs:
        digests.add(name, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
        yield name, t

SEQ_ERRORS_KEY = "seq_mult_prob_errors"  # grpo_step's per-sample sequence errors (a list, not a metric)


def _rows_key(rows: Sequence[tuple[int, dict, str]]) -> tuple:
    """Which rows a batch holds (task index and where each came from), to match a prefetch to its step."""
    return tuple((index, where) for index, _, where in rows)


def _merge_minibatch_metrics(rows: list[dict]) -> dict:
    """Metrics of several optimizer steps in one algorithm step: counts add up, extremes reduce, rest average."""
    if len(rows) == 1:
        return rows[0]
    out: dict[str, float] = {}
    for k in rows[0]:
        vals = [r[k] for r in rows if k in r]
        if k.startswith("train/num_") or k.startswith("timing/"):
            out[k] = sum(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_min"):
            out[k] = min(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out



class TrainingWorker:
    """One rank of the training backend: the policy under training (and its frozen reference), refit sending."""

    def __init__(self, spec: WorkerSpec, rank: int = 0, world_size: int = 1):
        _set_threads(spec.threads)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.device = _device(spec)
        self.backend = None
        self.sender = None
        self._next_samples = Prefetch()  # the next SFT step's samples, laid out while this one trains

    def where(self) -> dict:
        return here()

    def address(self) -> tuple[str, int]:
        """(host, port) of the rank group's rendezvous store, which rank 0 (asked this) serves on the node's
        address only (torch's own store would listen on every interface)."""
        import ray.util

        try:
            host = ray.util.get_node_ip_address()
        except Exception:
            host = "127.0.0.1"
        self._store, self._listener = master_store(host, self.world_size)
        return host, self._store.port

    def setup(self, master: tuple[str, int] | None = None) -> dict:
        """Join the rank group (if any) and build this rank of the training backend."""
        if self.world_size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            host, port = master
            store = getattr(self, "_store", None)
            if store is None:
                store = dist.TCPStore(host, port, world_size=self.world_size, is_master=False)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        backend_cls = TRAINING_BACKENDS.load(self.spec.training.backend)
        self.backend = backend_cls.create(self.spec.training_setup(), device=self.device, rank=self.rank,
                                          world_size=self.world_size)
        self.router = EnvRouter(self.spec.env)
        return {"parameters": self.backend.parameter_count()}

    # -- steps ---------------------------------------------------------------------------------------
    def _train_minibatches(self, minibatches: list[list[dict]], loss_fn) -> dict:
        return _merge_minibatch_metrics([self.backend.train_step(samples, loss_fn) for samples in minibatches])

    def grpo_step(self, minibatches: list[list[dict]], loss_fn, seq_error_threshold: float | None = None) -> dict:
        """Reference and old logprobs where needed, then one optimizer step per minibatch.

        With `seq_error_threshold`, samples whose sequence-level logprob error exceeds it are left out
        (gymv.algorithms.seq_error) and the metrics carry every sample's error under SEQ_ERRORS_KEY, in
        the order of `minibatches`. Its phases' seconds come back as timing keys (the driver's timer takes them):
        logprobs (every no-grad pass), reference (the reference policy's pass, inside logprobs), training."""
        timer = PhaseTimer()
        with timer.phase("logprobs"):
            flat = [as_tensors(s) for mb in minibatches for s in mb]
            if self.spec.kl_reference and flat:
                with timer.phase("reference"):
                    for s, lp in zip(flat, self.backend.compute_logprobs(flat, reference=True)):
                        s["logp_ref"] = lp
            # later minibatches see moved weights: ratios need the old policy; so does the sequence error
            if (len(minibatches) > 1 or seq_error_threshold is not None) and flat:
                for s, lp in zip(flat, self.backend.compute_logprobs(flat)):
                    s["logp_old"] = lp
            errors = None
            if seq_error_threshold is not None:
                minibatches, errors = drop_masked_samples(minibatches, seq_error_threshold)
        with timer.phase("training"):
            metrics = self._train_minibatches(minibatches, loss_fn)
        metrics.update(timer.metrics())
        metrics.update(phase_memory(self.device, "training", release=self.spec.shares_gpu))
        if errors is not None:
            metrics[SEQ_ERRORS_KEY] = errors
        return metrics

    def sft_samples(self, rows: Sequence[tuple[int, dict, str]]) -> list[dict]:
        """Training samples of the rows' gold answers (tokens exactly as the agent loop would lay them out)."""
        b, spec = self.backend, self.spec
        cache = ImageCache(max_pixels=spec.max_image_pixels)
        out = []
        for task_index, row, where in rows:
            traj = build_sft_sample(self.router(row, where), row, b.adapter, b.tokenizer, b.chat_template,
                                    max_seq_len=spec.model.max_seq_len, task_index=task_index,
                                    max_image_pixels=spec.max_image_pixels, image_cache=cache,
                                    chat_template_kwargs=dict(spec.generation.chat_template_kwargs) or None,
                                    tool_call_format=spec.rollout.tool_call_format)
            if getattr(traj, "error", None):
                raise GymvError(f"cannot build an SFT sample: {traj.error}", where=where,
                                fix="fix or drop that row (its rollout could not be built)")
            out.append(training_sample(traj.token_ids, traj.loss_mask, images=traj.images or (), where=where))
        return out

    def sft_step(self, rows: Sequence[tuple[int, dict, str]], loss_fn,
                 upcoming: Sequence[tuple[int, dict, str]] | None = None) -> dict:
        """One optimizer step on the rows' gold answers; its phases' seconds (samples, training) as timing keys.
        `upcoming`: the next step's rows, whose samples are laid out in the background while this step trains
        (`samples` is then the wait for them, if any)."""
        timer = PhaseTimer()
        with timer.phase("samples"):
            ready, samples = self._next_samples.take(_rows_key(rows))
            if not ready:
                samples = self.sft_samples(rows)
        if upcoming:
            nxt = list(upcoming)
            self._next_samples.start(_rows_key(nxt), lambda: self.sft_samples(nxt))
        with timer.phase("training"):
            metrics = self._train_minibatches([samples], loss_fn)
        metrics["train/num_input_tokens"] = self.backend.sum_over_ranks(sum(len(s["input_ids"]) for s in samples))
        metrics.update(timer.metrics())
        metrics.update(phase_memory(self.device, "training", release=self.spec.shares_gpu))
        return metrics

    # -- refit ---------------------------------------------------------------------------------------
    def _generation_dtype(self):
        import torch

        return getattr(torch, self.spec.generation_dtype)

    def refit_open(self, num_receivers: int, transport: str, senders: int = 1) -> dict | None:
        """Send refits over `transport`; with `senders` > 1 this rank ships its share of the buckets."""
        self.sender = make_sender(transport, self._generation_dtype(), self.device, num_receivers,
                                  self.spec.refit.bucket_mb, rank=self.rank, senders=senders)
        return {"info": self.sender.rendezvous(self._weights_to_send()), "in_band": self.sender.in_band}

    def refit_connect(self) -> None:
        self.sender.connect()

    def weights(self) -> dict:
        """A CPU copy of the weights (a replacement generation worker, tests); refits go through `publish`."""
        return {k: v.detach().cpu().clone() for k, v in self.backend.named_weights()}

    def follow_weights(self, check: CheckRequest | None = None) -> None:
        """A rank other than 0 joins the gathers of rank 0's `named_weights` (refit, hash, copy, export), and
        the probe's forward pass of a refit checked by probe."""
        if check is not None and check.kind == "probe":
            trainer_probe(self.backend, check.probe)
        if self.backend.gathers_weights:
            for _ in self.backend.named_weights():
                pass

    def _weights_to_send(self):
        """The weights for the sender, streamed as the backend yields them. A sharded trainer's are gathered
        here, all of them (ranks other than 0 join every gather, whether or not the sender reads them). Once
        the sender knows the layout (after the first refit) each gathered tensor goes straight into the
        sender's buffer and is dropped; the first refit holds them, cast to the generation dtype."""
        if not self.backend.gathers_weights or self.sender.layout is not None:
            return self.backend.named_weights()
        return held_for_first_refit(self.backend.named_weights(), self._generation_dtype())

    def publish(self, check: CheckRequest | None = None):
        """Send this refit; with `check`, also this side of its check (`refit_check` hands it out): the
        digests of the tensors as sent, in the generation dtype, or the probe's logprobs."""
        self._check = None
        account: dict = {}
        weights = self._weights_to_send()
        if check is not None and check.kind == "probe":
            account["probe"] = trainer_probe(self.backend, check.probe)
        digests = None
        if check is not None and check.kind == "digest" and self.rank == 0:
            digests = Digests()
            weights = _digesting(weights, self._generation_dtype(), digests)
        payload = self.sender.publish(weights)
        if digests is not None:
            account["digests"] = digests.result()
        self._check = account if check is not None else None
        return payload

    def refit_check(self) -> dict | None:
        """This rank's side of the check of the refit it last published (None: unchecked, or it failed)."""
        check, self._check = self._check, None
        return check

    def weights_check(self, check: CheckRequest) -> dict:
        """This side of a check outside a refit (the engines' initial weights): every rank calls it."""
        account: dict = {}
        if check.kind == "probe":
            account["probe"] = trainer_probe(self.backend, check.probe)
        elif self.rank == 0:
            account["digests"] = weight_digests(self.backend.named_weights(), self._generation_dtype())
        else:
            self.follow_weights()
        return account

    def refit_probe(self, tokens: int) -> Probe:
        """The fixed sequence of the probe check, from this trainer's tokenizer and adapter."""
        return build_probe(self.backend.tokenizer, self.backend.adapter, tokens)

    def weights_hash(self) -> str:
        return self.backend.weights_hash(self._generation_dtype())

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_bytes(self) -> int | None:
        return self.backend.checkpoint_bytes()

    def save(self, path: str) -> None:
        """The backend writes its state (rank 0 the weights and optimizer); every rank writes its RNG state."""
        import torch

        path_ = Path(path)
        try:
            self.backend.save(path_)
            torch.save(capture_rng_state(), path_ / f"rng_rank{self.rank}.pt")
        except Exception as e:  # a full or read-only disk, however the writer words it: an OSError for the driver
            refused = as_write_failure(e, path_)
            if refused is None:
                raise
            raise refused from None

    def load(self, path: str) -> int:
        import torch

        self.backend.load(path)
        rng = Path(path) / f"rng_rank{self.rank}.pt"
        if rng.exists():
            restore_rng_state(torch.load(rng, weights_only=True))
        return self.backend.steps

    def export(self, path: str) -> str:
        """Write a standalone Hugging Face checkpoint atomically: tmp folder, then rename (rank 0)."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.backend.export_hf(tmp)
        if self.rank != 0:
            return str(target)
        follow_umask(tmp)  # save_pretrained writes 0600 files; the export is for a team to read
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        return str(target)

    def close(self) -> bool:
        """Whether this rank left its group with its peers (always, for a single rank)."""
        self._next_samples.close()
        if self.sender is not None:
            self.sender.close()
        if self.backend is not None:
            self.backend.close()
        return leave_process_group() if self.world_size > 1 else True
