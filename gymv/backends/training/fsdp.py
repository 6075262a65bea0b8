"""FSDP2 for TorchTrainer: parameters, gradients and AdamW state sharded over the data-parallel ranks.

Each decoder layer is its own `fully_shard` unit (its weights are gathered just before it runs and freed
after), the root unit holds the rest of the language model (embeddings, final norm, head). Gradients are
reduce-scattered as SUMS, not averages: every rank's loss is already divided by global counts, so the sum
is the whole batch's gradient, exactly as one rank's would be.

The vision tower and projector stay replicated, their gradients summed by hand: a rank whose micro-batch
holds no image never runs them, and FSDP2 needs every rank to join the collectives of every unit it runs.

FSDP2 runs a collective in every unit's forward and backward, so ranks run in lock step: a rank with fewer
micro-batches than its peers adds passes that change nothing (TorchTrainer.lockstep).

Checkpoints are torch.distributed.checkpoint folders: each rank writes its shards, and a run resumes at any
other number of ranks (DCP reshards on load).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from gymv.backends.hf_forward import output_head
from gymv.backends.training.base import local_shard as _local
from gymv.backends.training.guarded_step import finite_or
from gymv.backends.training.micro_batches import pad_collate
from gymv.backends.training.rank_reductions import RankReductions
from gymv.backends.training.replicated_precision import VISION_MODULES, autocast_replicated, is_vision  # noqa: F401
from gymv.backends.training.torch_trainer import TRAINER_FILE, TorchTrainer, _fsync_replace
from gymv.backends.training.units import decoder_units
from gymv.errors import GymvError
from gymv.net import master_store
from gymv.sections import FsdpSection, TrainingSection

log = logging.getLogger(__name__)
DCP_FOLDER = "dcp"


_PRIVATE_STORE = None  # (store, listening socket) of a single rank's private group, kept open


def ensure_process_group(device: torch.device) -> None:
    """FSDP2 and DCP need a process group; a single rank gets a private one on 127.0.0.1."""
    global _PRIVATE_STORE
    if dist.is_initialized():
        return

    _PRIVATE_STORE = master_store("127.0.0.1", 1)  # torch's own store would listen on every interface
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=_PRIVATE_STORE[0], rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))


def _separate_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The input embedding, as its own unit: a VLM batch calls it outside the model's forward (to write image
    features over the placeholders), where the root unit would not collect its gradient. None when it is
    tied to the output head (one parameter cannot live in two units) or the model has none."""
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if get is not None else None
    if embed is None:
        return None

    head = output_head(model)
    if head is not None and head.weight is embed.weight:
        return None
    return embed


def mixed_precision(device: torch.device, autocast_dtype: torch.dtype | None):
    """bf16 compute with fp32 gradient reduction (the sharded master weights stay fp32); None in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if autocast_dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)


PINNED_EXACT_ABOVE_MB = 64
_PINNED_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


def pins_exactly(above_mb: int = PINNED_EXACT_ABOVE_MB) -> bool:
    """Whether a pinned host block over `above_mb` takes its own size, after asking torch's pinned allocator
    for that (a CUDA process). Why: the allocator rounds every block up to a power of two for reuse, and
    offloaded weights and gradients are pinned tensor by tensor: a 7B VLM's 272 MB MLP shards take 512 MB each,
    its 33 GB of float32 weights about 55 GB of host memory and as much again for the gradients (an 8B run on
    a 128 GB host was stopped for memory in its first training step). Blocks over the size are not cached
    either (a cached block is handed to any request of its power of two, so exact blocks must not be). A torch
    without the setting (2.11 has none; 2.13 has it) says False, found by pinning one block and reading what
    it took; so does a user's own PYTORCH_ALLOC_CONF pinned setting, which is left as it is."""
    env = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if any(k in env for k in _PINNED_KEYS) or not torch.cuda.is_available():
        return False
    ours = ",".join(f"{k}:{above_mb}" for k in _PINNED_KEYS)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(ours)
    except (RuntimeError, ValueError):
        return False
    size = (above_mb + above_mb // 2) * 2**20  # between two powers of two
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    probe = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    taken = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
    del probe
    return taken == size


def shard_model(model: torch.nn.Module, device: torch.device, autocast_dtype: torch.dtype | None,
                sharding: FsdpSection) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """fully_shard every unit and the root; returns the model and its replicated (vision) parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = model.to(device)
    replicated = [p for n, p in model.named_parameters() if is_vision(n)]
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": sharding.reshard_after_forward}
    mp = mixed_precision(device, autocast_dtype)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if sharding.cpu_offload:
        # pageable host memory where pinned blocks would round up: exact sizes, slower copies
        pinned = pins_exactly()
        if not pinned:
            log.warning("training.fsdp.cpu_offload keeps the weights and gradients in pageable host memory (this "
                        "torch rounds each pinned block up to a power of two, up to twice the memory)")
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pinned)
    for _, unit in decoder_units(model):
        fully_shard(unit, **kwargs)
    embed = _separate_embedding(model)
    if embed is not None:
        fully_shard(embed, **kwargs)
    elif replicated:
        raise GymvError("training.backend fsdp2 cannot shard a VLM whose input embedding is tied to its output head",
                        where="training.backend", fix="use training.backend: torch for this model")
    fully_shard(model, ignored_params=set(replicated), **kwargs)
    # make the model the root of every unit now: a VLM batch calls the embedding unit before the model's
    # forward, which would otherwise make the embedding a root of its own
    model._get_fsdp_state()._lazy_init()
    model.gymv_lockstep = True  # gymv.backends.logprobs: no shared-prefix path (see recomputes_activations)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    if replicated and dist.get_world_size() > 1:
        with torch.no_grad():
            for p in replicated:
                dist.broadcast(p.data, src=0)
    return model, replicated


def _full(t: Tensor, device: torch.device) -> Tensor:
    if not hasattr(t, "full_tensor"):
        return t
    if t.device != device:  # offloaded shards: gather on the compute device
        t = t.to(device)
    return t.full_tensor()


@contextlib.contextmanager
def rank_failure_raised() -> Iterator[None]:
    """DCP's CheckpointException as the first failing rank's own exception. Why: it derives from
    BaseException, which passes every `except Exception` (the checkpoint writer's test for a full disk among
    them) and made a disk that filled mid-save read as "unexpected pos 704 vs 598" with no cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = getattr(e, "failures", None) or {}
        if not failures:
            raise RuntimeError(str(e)) from None
        raise failures[min(failures)][0] from None


class FSDPTrainer(TorchTrainer):
    """TorchTrainer whose model is sharded with FSDP2 over the default process group (see the module doc)."""

    multi_rank = True
    lockstep = True
    fused = True  # as on CUDA, also on a CPU: the tests then run the step the GPU runs (DTensor shards)

    def __init__(self, model, logprob_fn, config: TrainingSection, *, trainable: bool = True, **kwargs):
        self.sharding = config.fsdp
        self.trainable = trainable
        if not trainable:  # a frozen reference: sharded like the policy, never stepped
            model.requires_grad_(False)
            kwargs.pop("process_group", None)
            self._init_frozen(model, logprob_fn, config, **kwargs)
            return
        super().__init__(model, logprob_fn, config, **kwargs)

    def _init_frozen(self, model, logprob_fn, config, *, collate_fn=pad_collate, device=None, plan_fn=None,
                     images_fn=None) -> None:
        self.config, self.logprob_fn, self.collate_fn, self.plan_fn = config, logprob_fn, collate_fn, plan_fn
        self.images_fn = images_fn
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.autocast_dtype = self._resolve_precision(config.dtype)
        ensure_process_group(self.device)
        self.ranks = RankReductions()
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        self.model = self._place(model)
        self.params, self.optimizer, self.steps = [], None, 0

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.device.type == "cpu" and self.sharding.cpu_offload:
            raise GymvError("training.fsdp.cpu_offload needs a CUDA device", where="training.fsdp.cpu_offload",
                            fix="set cpu_offload: false on a CPU (the weights are already in host memory)")
        ensure_process_group(self.device)
        self.ranks = RankReductions()
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        model, self.replicated = shard_model(model, self.device, self.autocast_dtype, self.sharding)
        if self.autocast_dtype is not None:
            self.precision = autocast_replicated(model, self.device.type, self.autocast_dtype)
            self.autocast_dtype = None  # FSDP casts the gathered weights itself (mixed-precision policy)
        return model

    def _step_images(self, samples, plan):
        # the tower reads root weights (a final vision norm): gathered first, on every rank alike
        if self.images_fn is not None:
            self.model.unshard()
        return super()._step_images(samples, plan)

    def _forward(self, mb):
        # the root unit (final norm, head) is gathered first on every rank: a batch with images calls the
        # embedding unit before the model's forward, a text batch inside it, and gathers must not reorder
        self.model.unshard()
        return super()._forward(mb)

    def _param_groups(self) -> list:
        """Sharded (DTensor) and replicated (plain) parameters in separate groups: AdamW's fused and foreach
        kernels take one group at a time and cannot mix DTensors with plain tensors."""
        ids = {id(p) for p in self.replicated}
        sharded = [p for p in self.params if id(p) not in ids]
        replicated = [p for p in self.params if id(p) in ids]
        return [{"params": group} for group in (sharded, replicated) if group]

    def _sync_grads(self) -> None:
        self.ranks.sum_grads_([p for p in self.replicated if p.requires_grad])

    def _start_micro_batch(self, last: bool) -> None:
        """One rank: gradients accumulate unsharded (in the reduce dtype) over the step's micro-batches and go
        through FSDP2's reduction once, after the last, instead of after every micro-batch (its per-unit
        copies and kernel launches were a large share of a step's host time). With R > 1 ranks each
        micro-batch reduce-scatters as before: accumulating unsharded would hold a full gradient per rank."""
        if self._defers_reduction():
            self.model.set_requires_gradient_sync(last)

    def _defers_reduction(self) -> bool:
        """Deferring holds every gradient unsharded in float32 until the last micro-batch, beside the sharded
        ones: 4 bytes per parameter more at the reduction (33 GB for a 7B VLM, the margin a single GPU lacks).
        `auto` defers where that is at most a tenth of the device's memory (or on a CPU)."""
        choice = self.sharding.defer_gradient_reduction
        if self.world_size != 1 or choice is False:
            return False
        if choice is True or self.device.type != "cuda":
            return True
        cached = getattr(self, "_defer_cached", None)
        if cached is None:
            grad_bytes = 4 * sum(p.numel() for p in self.params)
            total = torch.cuda.get_device_properties(self.device).total_memory
            cached = self._defer_cached = grad_bytes <= total / 10
        return cached

    def _local_grads(self) -> tuple[list[Tensor], list[Tensor]]:
        """(local shards of the sharded gradients, replicated gradients): plain tensors, for foreach kernels."""
        ids = {id(p) for p in self.replicated}
        sharded = [_local(p.grad) for p in self.params if p.grad is not None and id(p) not in ids]
        replicated = [p.grad for p in self.params if p.grad is not None and id(p) in ids]
        return sharded, replicated

    @staticmethod
    def _squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
        """Sum of squares in float64 over per-tensor norms (one multi-tensor kernel per device and dtype,
        instead of several kernels per parameter)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        by_device: dict = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for group in by_device.values():
            norms = torch._foreach_norm(group, 2.0)
            total += torch.stack(norms).double().pow(2).sum().to(device)
        return total

    def _grad_norm(self) -> Tensor:
        sharded, replicated = self._local_grads()
        sq_sharded = self._squared_norm(sharded, self.device)
        self.ranks.sum_(sq_sharded)
        return (sq_sharded + self._squared_norm(replicated, self.device)).sqrt().float()

    def _scale_grads(self, norm: Tensor) -> None:
        """min(1, max_grad_norm / (norm + 1e-6)), worked out in float64 on the device (no wait on the host);
        1 where the norm is not finite."""
        denominator = finite_or(norm, 0.0).double() + 1e-6
        coef = (torch.full_like(denominator, self.config.max_grad_norm) / denominator).clamp(max=1.0).float()
        by_device: dict = {}
        for g in (g for group in self._local_grads() for g in group):
            by_device.setdefault(g.device, []).append(g)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))

    def named_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Each weight gathered in full, one at a time (a collective: every rank iterates); tied names yield
        the same tensor."""
        sd = self.model.state_dict()
        uses: dict[int, int] = {}
        for t in sd.values():
            uses[id(t)] = uses.get(id(t), 0) + 1
        tied: dict[int, Tensor] = {}
        with torch.no_grad():
            for name, t in sd.items():
                key = id(t)
                full = tied.get(key)
                if full is None:
                    full = _full(t.detach(), self.device)
                uses[key] -= 1
                if uses[key]:
                    tied[key] = full
                else:
                    tied.pop(key, None)
                yield name, full

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.named_full_weights())

    # -- checkpoints (torch.distributed.checkpoint) ----------------------------------------------------
    def _dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, path: str | os.PathLike) -> None:
        """Every rank writes its shards into `path`/dcp; rank 0 writes the step count."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with rank_failure_raised():
            dcp.save(self._dcp_state(), checkpoint_id=str(path / DCP_FOLDER))
        if self.rank == 0:
            tmp = path / f".{TRAINER_FILE}.tmp"
            tmp.write_text(json.dumps({"steps": self.steps, "config": self.config.model_dump(mode="json"),
                                       "world_size": self.world_size, "format": "dcp"}))
            _fsync_replace(tmp, path / TRAINER_FILE)
        dist.barrier()

    def load(self, path: str | os.PathLike) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        path = Path(path)
        if not (path / DCP_FOLDER / ".metadata").exists():
            raise GymvError("no sharded (torch.distributed.checkpoint) state found", where=str(path),
                            fix=f"expected {DCP_FOLDER}/.metadata: resume with the training backend that wrote the checkpoint")
        folder = str(path / DCP_FOLDER)
        state = self._dcp_state()
        # a parameter that never had a gradient has no AdamW state in the checkpoint: it must get none here
        # either (get_state_dict gives every parameter a fresh one, whose step count would then be off)
        prefix = "optimizer.state."
        saved = {k[len(prefix):].rsplit(".", 1)[0] for k in dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
                 if k.startswith(prefix)}
        state["optimizer"]["state"] = {k: v for k, v in state["optimizer"]["state"].items() if k in saved}
        with rank_failure_raised():
            dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=False))
        for name, p in self.model.named_parameters():
            if name not in saved:
                self.optimizer.state.pop(p, None)
        meta = path / TRAINER_FILE
        self.steps = int(json.loads(meta.read_text())["steps"]) if meta.exists() else 0
