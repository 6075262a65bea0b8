"""The `megatron` training backend: the language decoder runs as Megatron-core's GPTModel (local layer spec),
loaded from and written back to HF names by gymv's own mapping (gymv.backends.training.megatron_weights).

Everything around the model is the `torch` backend's: the same losses over `training_sample`, token-budget
micro-batches, data parallel over the trainer's ranks, torch AdamW (megatron's distributed optimizer, with its DDP
wrapper and gradient buffers, allocates on CUDA and accepts only CUDA parameters, so no CPU test could check
it: docs/training.md, "Why not megatron's distributed optimizer"), bf16 autocast on CUDA. Checkpoints and exports are HF
folders (weights under HF names, so a checkpoint loads with `from_pretrained` too); refits send HF names.

Wired here: text decoders (Llama, Qwen2, Qwen3) and LLaVA-style, Qwen2-VL and Qwen2.5-VL vision-language
models (the vision tower and projector stay torch modules, trained too; their image features reach GPTModel
as its decoder_input; 3-D rotary positions go through megatron's mrope), Nemotron 3 Omni (its Nemotron-H
decoder as gymv's hybrid Megatron model, gymv.backends.training.megatron_hybrid), with tensor parallelism
(gymv.backends.training.megatron_tp), and sequence packing (`training.sequence_packing`: one row per
micro-batch, each sequence attending to itself alone through SdpaCoreAttention). Context parallelism runs
the Nemotron-H hybrid model (gymv.backends.training.megatron_cp: a replica's TP x CP ranks train the union of
their samples, gradients summed over data x context ranks). Expert parallelism runs the hybrid model too
(gymv.backends.training.megatron_ep_trainer: each expert whole, megatron's expert TP 1, the EP group folded
over TP, CP and data ranks; lock-step micro-batches over ranks holding different samples, expert gradients
summed over the expert-data-parallel ranks; weights out gather the experts over EP; one optimizer file per
TP x EP shard pair). The MoE aux loss at EP is each rank's micro-batches' own, as under data
parallelism (the router is whole on every EP rank and sees that rank's tokens). Pipeline parallelism is
refused, as are VLMs with other decoder inputs (Qwen3-VL, Gemma 3).

Each rank reads only its shard of the checkpoint (`shard_source`): the HF model is built on the meta device,
its vision tower and projector are read whole, and the twin asks the checkpoint's safetensors for its TP
slices and its EP block of experts alone (gymv.backends.model_weights), so a rank's host memory holds its
shard and one tensor, not the model. A checkpoint without safetensors is refused, naming its folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gymv.backends import packed_attention
from gymv.backends.checkpoint_files import CheckpointFiles
from gymv.backends.model_weights import ModelWeights, fill_except
from gymv.backends.moe_router import RouterTerms
from gymv.backends.multimodal import GridAdapter, MultimodalAdapter
from gymv.backends.policy import Policy, load_policy
from gymv.backends.training.base import TrainingSetup
from gymv.backends.training.hf_torch import BatchLayout, HFTorchBackend, copy_hf_files
from gymv.backends.training.megatron_model import (
    MegatronCausalLM,
    MegatronVLM,
    build_gpt,
    checkpoint_layers,
    init_parallel,
    strip_language_model,
)
from gymv.backends.training.megatron_cp import (
    ContextParallelCausalLM,
    ContextParallelTrainer,
    ContextParallelVLM,
    build_context_parallel_hybrid,
)
from gymv.backends.training.megatron_ep_trainer import ExpertParallelTrainer
from gymv.backends.training.megatron_parallel import expert_parallel_factories, groups, init_model_parallel
from gymv.backends.training.megatron_tp import ReplicaTrainer, TensorParallelTrainer, gather_state, union_over_tp
from gymv.backends.training import megatron_hybrid_weights, megatron_weights
from gymv.backends.training.megatron_hybrid import build_hybrid
from gymv.backends.training.megatron_hybrid_weights import HybridShape
from gymv.backends.training.megatron_weights import DecoderShape
from gymv.backends.training.torch_trainer import MODEL_SAFETENSORS, OPTIMIZER_FILE, TRAINER_FILE, _fsync_replace
from gymv.errors import GymvError

REFUSED_PARALLEL = ("pipeline",)


def _check_setup(setup: TrainingSetup) -> None:
    for name in REFUSED_PARALLEL:
        size = getattr(setup.training.parallel, name)
        if size > 1:
            raise GymvError(f"training.backend megatron runs training.parallel.{name} 1 here, not {size}",
                            where=f"training.parallel.{name}",
                            fix="set it to 1 (data parallel over the training GPUs), or use training.backend: fsdp2")


def gather_experts(state: dict[str, Tensor]) -> list[list[dict[str, Tensor]]]:
    """`[ep rank][0]` state dicts of the routed experts (each whole: expert TP 1), gathered over megatron's
    EP group from this rank's own, as megatron_to_hf takes them (`expert_shards`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    grid: list[list[dict[str, Tensor]]] = [[{}] for _ in range(dist.get_world_size(group))]
    for name in sorted(k for k in state if any(p in k for p in megatron_hybrid_weights.EXPERT_SHARDED)):
        parts = [torch.empty_like(state[name]) for _ in grid]
        dist.all_gather(parts, state[name].contiguous(), group=group)
        for row, part in zip(grid, parts):
            row[0][name] = part
    return grid


def first_holder(keys: list[Any], rank: int) -> bool:
    """Whether `rank` is the lowest rank whose shard key (`keys[rank]`, every rank's in rank order) it holds."""
    return keys.index(keys[rank]) == rank


def is_hybrid(config) -> bool:
    """A Nemotron-H decoder (Nemotron 3 Omni's): gymv's Megatron hybrid model (megatron_hybrid), not GPTModel."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", "") in megatron_hybrid_weights.MODEL_TYPES


def mapping(shape):
    """The HF <-> Megatron mapping module of a decoder shape (GPTModel's or the hybrid model's)."""
    return megatron_hybrid_weights if isinstance(shape, HybridShape) else megatron_weights


def _hf_names(model) -> dict:
    """Where the decoder's weights and the head sit in this HF model's state dict."""
    keys = list(model.state_dict())
    table = ".embeddings.weight" if is_hybrid(model.config) else "embed_tokens.weight"
    embed = [k for k in keys if k.endswith(table) and (table[0] != "." or k.endswith("model" + table))]
    if len(embed) != 1:
        raise GymvError("cannot find the language model's token embedding in the checkpoint", where="model.path",
                        fix="use training.backend: torch or fsdp2 for this model")
    head = "lm_head.weight" if "lm_head.weight" in keys else next((k for k in keys if k.endswith("lm_head.weight")),
                                                                  "lm_head.weight")
    return {"hf_prefix": embed[0][: -len(table.lstrip("."))], "hf_head": head}


def _check_vlm(adapter) -> None:
    """A VLM runs here when its decoder takes image features in its input embeddings alone, with plain or
    3-D rotary positions (LLaVA-style, Qwen2-VL, Qwen2.5-VL); features fed to several layers (Qwen3-VL) or
    extra model inputs (Gemma 3) are not mapped."""
    for hook in ("position_ids", "feature_inputs", "forward_kwargs"):
        mine = getattr(type(adapter), hook)
        if mine is not getattr(MultimodalAdapter, hook) and mine is not getattr(GridAdapter, hook):
            raise GymvError(f"training.backend megatron does not map this vision-language family's {hook} "
                            f"({type(adapter).__name__})", where="model.path",
                            fix="use training.backend: torch or fsdp2 for this model")


def check_maps(policy):
    """The decoder's `DecoderShape`; GymvError (naming model.path) unless gymv's Megatron twin maps this model's
    decoder and, for a VLM, how its image features reach the decoder."""
    if getattr(policy.model.config, "vision_config", None) is not None:
        _check_vlm(policy.adapter)
    shape_class = HybridShape if is_hybrid(policy.model.config) else DecoderShape
    return shape_class.of(policy.model.config, **_hf_names(policy.model))


def shard_source(path: str | os.PathLike, *, seed: int = 0, trust_remote_code: bool = False,
                 dtype: torch.dtype = torch.float32, decoder_only: bool = False) -> tuple[Policy, ModelWeights]:
    """The policy of checkpoint `path` with its HF model's decoder and head left on the meta device and the rest
    (vision tower, projector) read whole, and the checkpoint under that model's names, from which
    `megatron_twin` reads this rank's shard alone. GymvError naming the checkpoint where it has no safetensors
    or its tensors do not fill the model. `decoder_only`: the rest stays unread too (a text-only cut of a VLM)."""
    policy = load_policy(path, device="cpu", dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
                         skeleton=True)
    shape = check_maps(policy)
    weights = ModelWeights(CheckpointFiles(policy.path), policy.model)
    if not decoder_only:
        fill_except(policy.model, weights, (shape.hf_prefix, shape.hf_head))
    return policy, weights


def megatron_twin(hf_model, hf_config, shape: DecoderShape | HybridShape, *, tensor_parallel: int,
                  device: torch.device, dtype: torch.dtype = torch.float32,
                  context_parallel: int = 1, expert_parallel: int = 1,
                  weights: Mapping[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """This rank's Megatron twin of an HF model (its TP shard of the decoder: GPTModel, or for Nemotron-H
    gymv's hybrid model; a VLM keeps its vision tower), with the HF call gymv's logprob functions make. The
    trainer and the Megatron teacher build it alike, so a teacher scores with exactly the model a Megatron
    student trains. `context_parallel` > 1: the hybrid model over megatron's CP group (megatron_cp);
    `expert_parallel` > 1: its experts split over megatron's EP group (megatron_parallel). `weights`: where the
    decoder's HF weights are read (`shard_source`'s, for a model whose decoder is on the meta device; default
    the model's own state dict)."""
    from megatron.core import parallel_state

    build = build_hybrid if isinstance(shape, HybridShape) else build_gpt
    extra: dict[str, Any] = {}
    if expert_parallel > 1:
        shape.check_parallel(tensor_parallel, expert_parallel)
        ep = {k: v for k, v in groups().items() if k != "cp"}
        extra = {"groups": ep, "factories": expert_parallel_factories(shape, ep["ep"]),
                 "ep_rank": parallel_state.get_expert_model_parallel_rank(), "ep_size": expert_parallel}
    if context_parallel > 1:
        def build(*args, **kwargs):
            return build_context_parallel_hybrid(*args, cp_group=parallel_state.get_context_parallel_group(), **kwargs)
    gpt = build(hf_config, shape, tensor_parallel=tensor_parallel, device=device, dtype=dtype,
                **{k: v for k, v in extra.items() if k in ("groups", "factories")})
    state = mapping(shape).hf_to_megatron(hf_model.state_dict() if weights is None else weights, shape,
                                          tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                          tp_size=tensor_parallel,
                                          **{k: v for k, v in extra.items() if k in ("ep_rank", "ep_size")})
    gpt.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)
    pad = getattr(hf_model.get_input_embeddings(), "padding_idx", None)
    if getattr(hf_config, "vision_config", None) is not None:
        vision = strip_language_model(hf_model, shape).to(device=device, dtype=dtype)
        return (ContextParallelVLM if context_parallel > 1 else MegatronVLM)(gpt, shape, hf_config, vision, pad)
    return (ContextParallelCausalLM if context_parallel > 1 else MegatronCausalLM)(gpt, shape, hf_config, pad)


class MegatronBackend(HFTorchBackend):
    """One data-parallel rank whose policy (and KL reference) is a GPTModel twin of the HF decoder."""

    trainer_class = ReplicaTrainer

    def __init__(self, policy, setup: TrainingSetup, *, device: Any, rank: int = 0, world_size: int = 1,
                 weights: Mapping[str, Tensor] | None = None):
        """`weights`: the policy's weights as `shard_source` reads them (default: its HF model holds them)."""
        self._weights = weights
        self.checkpoint_reads: dict[str, int] = {}  # what building the policy's twin read, bytes by stored name
        self.shape = check_maps(policy)
        self.hf_config = policy.model.config
        self.vision = getattr(self.hf_config, "vision_config", None) is not None
        # HF state dicts list a tied head under its own name too; the generator is sent what it holds
        self.sends_tied_head = self.shape.tied and self.shape.hf_head in policy.model.state_dict()
        self.device = torch.device(device)
        self.tp = setup.training.parallel.tensor
        self.cp = setup.training.parallel.context
        self.ep = setup.training.parallel.expert
        self.gathers_weights = self.tp > 1 or self.ep > 1
        if self.ep > 1 and not isinstance(self.shape, HybridShape):
            raise GymvError("training.backend megatron runs expert parallelism for Nemotron-H decoders only",
                            where="training.parallel.expert", fix="set it to 1 for this model")
        if self.cp > 1 and not isinstance(self.shape, HybridShape):
            raise GymvError("training.backend megatron runs context parallelism for Nemotron-H decoders only",
                            where="training.parallel.context", fix="set it to 1 for this model")
        super().__init__(policy, setup, device=device, rank=rank, world_size=world_size)
        policy.model = self.trainer.model  # the HF copy is not kept

    @classmethod
    def create(cls, setup: TrainingSetup, *, device: Any, rank: int = 0, world_size: int = 1) -> MegatronBackend:
        _check_setup(setup)
        parallel = setup.training.parallel
        if parallel.context > 1 or parallel.expert > 1:
            init_model_parallel(parallel.tensor, parallel.context, parallel.expert, device=device)
            if torch.device(device).type == "cuda":
                from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(setup.seed)
        else:
            init_parallel(parallel.tensor, torch.device(device), seed=setup.seed)
        policy, weights = shard_source(setup.model_path, seed=setup.seed, trust_remote_code=setup.trust_remote_code)
        return cls(policy, setup, device=device, rank=rank, world_size=world_size, weights=weights)

    def _make_reference(self, device):
        """The KL reference's twin, read from the checkpoint as the policy's is: this rank's shard alone."""
        policy, weights = shard_source(self.setup.model_path, seed=self.setup.seed,
                                       trust_remote_code=self.setup.trust_remote_code)
        return self._make_trainer(policy.model, device, frozen=True, weights=weights)

    def _twin(self, hf_model, weights: Mapping[str, Tensor] | None) -> torch.nn.Module:
        twin = megatron_twin(hf_model, self.hf_config, self.shape, tensor_parallel=self.tp, device=self.device,
                             context_parallel=self.cp, expert_parallel=self.ep, weights=weights)
        if isinstance(weights, ModelWeights):
            weights.files.close()
        return twin

    def compile_layers(self, model, frozen: bool) -> None:
        if self.setup.training.compile:
            raise GymvError("training.compile is not wired for training.backend megatron", where="training.compile",
                            fix="set training.compile: false (it compiles the torch and fsdp2 backends' layers)")

    def _make_trainer(self, model, device, *, frozen: bool = False, weights: Mapping[str, Tensor] | None = None):
        self.compile_layers(model, frozen)
        if not frozen:
            weights = self._weights
            self._weights = None  # read once: the twin holds them now
        twin = self._twin(model, weights)
        if not frozen and isinstance(weights, ModelWeights):
            self.checkpoint_reads = dict(weights.files.read_bytes)
        if not frozen:  # the twin's routers (the HF model's are never called)
            self.router_terms = RouterTerms.attach(twin, self.setup.training.moe)
        if self.setup.training.gradient_checkpointing and not frozen:
            checkpoint_layers(twin.gpt)
        if self.tp == 1 and self.cp == 1 and self.ep == 1:
            return super()._make_trainer(twin, device, frozen=frozen)
        from megatron.core import parallel_state

        if frozen:
            twin.requires_grad_(True)  # TorchTrainer refuses a model without trainable parameters; never stepped
        layout = self.layout(twin)
        if self.ep > 1:
            return ExpertParallelTrainer(twin, self.trainer_logprob_fn(frozen), self.config, collate_fn=layout.collate,
                                         device=device, process_group=parallel_state.get_data_parallel_group(),
                                         plan_fn=layout.plan, ep_group=parallel_state.get_expert_model_parallel_group(),
                                         expert_dp_group=parallel_state.get_expert_data_parallel_group(),
                                         cp_group=parallel_state.get_context_parallel_group() if self.cp > 1 else None)
        if self.cp > 1:
            return ContextParallelTrainer(twin, self.trainer_logprob_fn(frozen), self.config, collate_fn=layout.collate,
                                          device=device, process_group=parallel_state.get_data_parallel_group(),
                                          plan_fn=layout.plan, cp_group=parallel_state.get_context_parallel_group())
        return TensorParallelTrainer(twin, self.trainer_logprob_fn(frozen), self.config, collate_fn=layout.collate, device=device,
                                     process_group=parallel_state.get_data_parallel_group(), plan_fn=layout.plan)

    def layout(self, model):
        """Padded or packed rows, as the torch backend lays them out. A packed row needs gymv's packed
        attention in GPTModel's attention slot (SdpaCoreAttention): without it, attention over the row would
        cross its sequences, so a model that cannot use it (sliding windows, soft-capping) runs padded rows
        under `auto` and is refused under `true`."""
        packing = self.setup.training.sequence_packing
        why_not = packed_attention.supports(model)
        if why_not is not None:
            if packing is True:
                raise GymvError(f"training.backend megatron packs sequences with gymv's packed attention, which this "
                                f"model cannot use ({why_not})", where="training.sequence_packing",
                                fix="set training.sequence_packing: auto or false")
            packing = False
        return BatchLayout(self.adapter, model, self.pad_id, packing)

    def _replica_group(self):
        """The ranks that run one replica's samples together: its TP x CP ranks."""
        from megatron.core import parallel_state

        return parallel_state.get_tensor_and_context_parallel_group()

    def train_step(self, samples, loss_fn):
        if self.tp > 1 or self.cp > 1:  # a replica's TP and CP ranks run the same samples: all of theirs
            samples = union_over_tp(samples, self._replica_group())[0]
        return super().train_step(samples, loss_fn)

    def compute_logprobs(self, samples, *, reference: bool = False):
        if self.tp == 1 and self.cp == 1:
            return super().compute_logprobs(samples, reference=reference)

        everyone, mine = union_over_tp(samples, self._replica_group())
        return super().compute_logprobs(everyone, reference=reference)[mine]

    def sum_over_ranks(self, value: float) -> float:
        import torch.distributed as dist

        if self.world_size == 1:
            return float(value)
        t = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(t)  # every rank's own share, TP peers included
        return float(t)

    def _hf_weights(self, *, include_tied_head: bool) -> Iterator[tuple[str, Tensor]]:
        model = self.trainer.model
        if self.vision:
            yield from ((k, v.detach()) for k, v in model.vision_model.state_dict().items())
        state = {k: v.detach() for k, v in model.gpt.state_dict().items() if isinstance(v, Tensor)}
        to_hf = mapping(self.shape).megatron_to_hf
        if self.ep == 1:
            shards = gather_state(state) if self.tp > 1 else [state]
            yield from to_hf(shards, self.shape, include_tied_head=include_tied_head)
            return

        # under EP each expert is whole on one rank: gathered once over the EP group, not over TP as well
        experts = gather_experts(state)
        dense = {k: v for k, v in state.items() if not any(p in k for p in megatron_hybrid_weights.EXPERT_SHARDED)}
        shards = gather_state(dense) if self.tp > 1 else [dense]
        yield from to_hf(shards, self.shape, include_tied_head=include_tied_head, expert_shards=experts)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        yield from self._hf_weights(include_tied_head=self.sends_tied_head)

    def _hf_state_for_files(self) -> dict[str, Tensor] | None:
        """The HF-named weights as files hold them (no tied head), on host memory; every rank joins the TP
        gathers, rank 0 alone keeps the result."""
        state = {k: v.detach().cpu().contiguous() for k, v in self._hf_weights(include_tied_head=False)}
        return state if self.rank == 0 else None

    @staticmethod
    def _write_hf_weights(path: Path, state: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        tmp = path / f".{MODEL_SAFETENSORS}.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        _fsync_replace(tmp, path / MODEL_SAFETENSORS)

    def _optimizer_file(self) -> str:
        """Optimizer state is per TP (and EP) shard: one file per TP rank, or per (TP rank, EP rank) pair
        under EP (see `_writes_optimizer` for who writes it)."""
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_rank()
        if self.ep > 1:
            return f"optimizer_tp{tp}_ep{parallel_state.get_expert_model_parallel_rank()}.pt"
        return OPTIMIZER_FILE if self.tp == 1 else f"optimizer_tp{tp}.pt"

    def _writes_optimizer(self) -> bool:
        """Whether this rank writes its optimizer shard: the first replica's ranks (under EP, the lowest rank
        holding each (TP rank, EP rank) pair: its dense TP shard and its block of experts, which no single
        replica covers when EP is below TP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.ep > 1:
            keys: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(keys, (parallel_state.get_tensor_model_parallel_rank(),
                                          parallel_state.get_expert_model_parallel_rank()))
            return first_holder(keys, dist.get_rank())
        return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0

    def checkpoint_bytes(self) -> None:
        """Not told: rank 0 writes the gathered weights and each first-replica rank its optimizer shard."""
        return None

    def save(self, path: str | os.PathLike) -> None:
        """Rank 0 writes the weights under HF names (the folder loads as a model, and as this backend's
        checkpoint) and the step count; each TP rank of the first replica its optimizer state."""
        from megatron.core import parallel_state

        path = Path(path)
        state = self._hf_state_for_files()
        if not self._writes_optimizer():
            return
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{self._optimizer_file()}.tmp"
        torch.save(self.trainer.optimizer.state_dict(), tmp)
        _fsync_replace(tmp, path / self._optimizer_file())
        if state is None:
            return
        self._write_hf_weights(path, state)
        tmp = path / f".{TRAINER_FILE}.tmp"
        tmp.write_text(json.dumps({"steps": self.trainer.steps, "config": self.trainer.config.model_dump(mode="json"),
                                   "tensor_parallel": self.tp, "expert_parallel": self.ep}))
        _fsync_replace(tmp, path / TRAINER_FILE)
        copy_hf_files(self.setup.model_path, path)

    def load(self, path: str | os.PathLike) -> None:
        from megatron.core import parallel_state

        path = Path(path)
        for name in (MODEL_SAFETENSORS, self._optimizer_file()):
            if not (path / name).exists():
                raise GymvError(f"no {name} in the checkpoint", where=str(path),
                                fix="resume from a checkpoint written by gymv train at the same tensor and expert "
                                    "parallel sizes")
        hf = CheckpointFiles(path)  # HF names as written; this rank's shard is read alone
        try:
            if self.vision:
                vision = self.trainer.model.vision_model
                vision.load_state_dict({k: hf[k] for k in vision.state_dict()}, strict=True)
            ep = {"ep_rank": parallel_state.get_expert_model_parallel_rank(), "ep_size": self.ep} if self.ep > 1 else {}
            shard = mapping(self.shape).hf_to_megatron(hf, self.shape, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                                       tp_size=self.tp, **ep)
            self.trainer.model.gpt.load_state_dict(shard, strict=True)
        except (KeyError, RuntimeError) as e:
            raise GymvError(f"checkpoint does not match the model ({str(e).splitlines()[0][:200]})",
                            where=str(path / MODEL_SAFETENSORS),
                            fix="load a checkpoint written by the same model architecture") from None
        finally:
            hf.close()
        self.trainer.optimizer.load_state_dict(torch.load(path / self._optimizer_file(), map_location=self.device,
                                                          weights_only=True))
        meta = path / TRAINER_FILE
        self.trainer.steps = int(json.loads(meta.read_text())["steps"]) if meta.exists() else 0

    def export_hf(self, path: str | os.PathLike) -> None:
        state = self._hf_state_for_files()
        if state is None:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._write_hf_weights(path, state)
        copy_hf_files(self.setup.model_path, path)
