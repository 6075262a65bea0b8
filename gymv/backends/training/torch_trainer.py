"""Plain-PyTorch training backend: AdamW, token-budget micro-batches, global-token normalisation, bf16 autocast
on CUDA, and a hard stop on non-finite losses.

One rank. Its multi-rank subclasses (FSDP2's FSDPTrainer, megatron's replica trainers) make their ranks'
gradients agree; this class only adds up their counts, metrics and non-finite flags (rank_reductions).

The model is any torch module; how logprobs come out of it (text LM, VLM with images, temperature,
forbidden vision tokens) is the `logprob_fn` it is given, so the trainer stays model-agnostic.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.profiler import record_function

from gymv.backends.training.adamw_bf16 import AdamWBf16State
from gymv.backends.training.base import (CollateFn, GlobalCounts, ImagesFn, LogprobFn, LossFn, MicroBatch, PlanFn,
                                         Sample, local_shard)
from gymv.backends.training.guarded_step import drop_fresh_state, finite_or, skips_on_device, step_unless
from gymv.backends.training.micro_batches import pad_collate, plan_micro_batches
from gymv.backends.training.rank_reductions import RankReductions
from gymv.backends.training.replicated_precision import ReplicatedPrecision, autocast_replicated
from gymv.backends.training.step_copy import StepCopy
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from gymv.timing import phase_key

try:
    import safetensors.torch as _st
except ImportError:  # pragma: no cover - safetensors ships with transformers
    _st = None

MODEL_SAFETENSORS = "model.safetensors"
MODEL_TORCH = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.json"
_LOSS, _MICRO_BATCHES = " loss", " micro_batches"  # not metric names a loss function could return


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """Host tensors go to a GPU through pinned memory: a copy from pageable memory would wait for the device's
    queue to drain, so the host could not prepare this micro-batch while the last one still runs."""
    def move(v: Tensor) -> Tensor:
        if device.type == "cuda" and v.device.type == "cpu":
            v = v.pin_memory()
        return v.to(device, non_blocking=True)

    return {k: (move(v) if isinstance(v, Tensor) else v) for k, v in mb.items()}


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


class TorchTrainer:
    """One optimizer step per `train_step` call, over all micro-batches of this rank's samples."""

    def __init__(
        self,
        model: torch.nn.Module,
        logprob_fn: LogprobFn,
        config: TrainingSection = TrainingSection(),
        *,
        collate_fn: CollateFn = pad_collate,
        device: torch.device | str | None = None,
        process_group=None,
        plan_fn: PlanFn | None = None,
        images_fn: ImagesFn | None = None,
    ):
        self.config = config
        self.logprob_fn = logprob_fn
        self.collate_fn = collate_fn
        self.plan_fn = plan_fn
        self.images_fn = images_fn
        first = next(model.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        self.ranks = RankReductions(process_group)
        self.rank, self.world_size = self.ranks.rank, self.ranks.world_size
        if self.ranks.distributed and not self.multi_rank:
            raise GymvError(f"training.backend torch trains on one rank, not {self.world_size}", where="training.backend",
                            fix="set training.backend: fsdp2, which shards the same trainer over the ranks")
        self.autocast_dtype = self._resolve_precision(config.dtype)
        self.precision: ReplicatedPrecision | None = None  # the vision tower's (replicated_precision)
        self.step_copy: StepCopy | None = None  # the language model's matrices a step (step_copy)
        self.model = self._place(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise GymvError("the model has no trainable parameters", where="trainer", fix="unfreeze at least one parameter")
        self.optimizer = self._make_optimizer(config)
        self.steps = 0

    def _make_optimizer(self, config: TrainingSection) -> torch.optim.Optimizer:
        common = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay)
        if config.optimizer_state_dtype == "bfloat16":
            return AdamWBf16State(self._param_groups(), **common)
        fused = self.fused if self.fused is not None else self.device.type == "cuda"
        kernel = {"fused": True} if fused else {"foreach": self.foreach}
        return torch.optim.AdamW(self._param_groups(), **common, **kernel)

    # -- what a multi-rank subclass replaces ------------------------------------------------------------
    multi_rank = False  # True: _sync_grads makes the ranks' gradients agree (else more than one rank is refused)
    lockstep = False  # True: every rank runs the same number of forward/backward passes (collectives inside)
    foreach: bool | None = None  # AdamW's multi-tensor kernels (where not fused): None = torch's default
    # AdamW's fused kernel (one pass over each parameter group instead of a dozen multi-tensor passes):
    # None = on CUDA only
    fused: bool | None = None
    copies_weights = True  # training.weight_copy applies (a subclass whose layers are not torch's own: False)

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if self.autocast_dtype is not None:
            self.precision = autocast_replicated(model, self.device.type, self.autocast_dtype)
            if self.copies_weights and self.config.weight_copy:
                self.step_copy = StepCopy(model, self.autocast_dtype)
        return model

    def _param_groups(self) -> list:
        """What AdamW steps: one group of every trainable parameter."""
        return self.params

    def _sync_grads(self) -> None:
        """Make every rank's gradients the whole batch's, before the norm (one rank: they are)."""

    def _start_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch of a step; `last`: no backward pass of this step follows it."""

    def _grad_norm(self) -> Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros((), device=self.device)

    def _scale_grads(self, norm: Tensor) -> None:
        """Multiply by min(1, max_grad_norm / (norm + 1e-6)) on the device; by 1 where the norm is not finite."""
        torch.nn.utils.clip_grads_with_norm_(self.params, self.config.max_grad_norm, finite_or(norm, 0.0))

    def _idle_pass(self, mb: MicroBatch, backward: bool) -> None:
        """A pass that changes nothing, so a lock-step rank with fewer micro-batches joins its peers' collectives."""
        logp, entropy, _ = self._forward(mb)
        if backward:
            zero = logp.sum() * 0 + (entropy.sum() * 0 if entropy is not None else 0)
            zero.backward()

    def _micro_batches_to_match(self, mine: int) -> int:
        """How many idle passes this rank adds so that every rank runs as many as the busiest."""
        if not self.lockstep or not self.ranks.distributed:
            return 0
        most = self.ranks.max_(torch.tensor([float(mine)], device=self.device))
        return int(most) - mine

    def _resolve_precision(self, dtype: str) -> torch.dtype | None:
        """training.dtype as the autocast dtype: None for float32; auto is bfloat16 where the GPU has it."""
        cuda = self.device.type == "cuda"
        if dtype == "float32":
            return None
        if dtype == "auto":
            return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
        if dtype == "bfloat16":
            if not (cuda and torch.cuda.is_bf16_supported()):
                raise GymvError("training.dtype bfloat16 needs a CUDA device with bf16 support", where="training.dtype",
                               fix="use training.dtype: auto (float32 on CPU)")
            return torch.bfloat16
        raise ValueError(f"unknown training.dtype {dtype!r}: auto, float32 or bfloat16")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(self, mb: MicroBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(logprobs, entropies or None, candidate logprobs or None): what the logprob function returned."""
        with self._autocast():
            logp, entropy, *rest = self.logprob_fn(self.model, mb)
        candidates = rest[0] if rest else None
        as_float = lambda t: t.float() if t is not None else None  # noqa: E731
        return logp.float(), as_float(entropy), as_float(candidates)

    def _step_weights(self) -> contextlib.ExitStack:
        """A context over a step's passes, forward and backward: the vision tower reads one cast copy of its
        weights (gymv.backends.training.replicated_precision), and so do the language model's matrices
        (gymv.backends.training.step_copy)."""
        stack = contextlib.ExitStack()
        if self.precision is not None and self.precision.names:
            stack.enter_context(self.precision.working_copy())
        if self.step_copy is not None:
            stack.enter_context(self.step_copy.working_copy())
        return stack

    def _step_images(self, samples: Sequence[Sample], plan: list[list[int]]):
        """The step's images through the vision tower once, for every micro-batch (gymv.backends.step_images);
        None where the layout gives no `images_fn` or declines."""
        if self.images_fn is None:
            return None
        with record_function("gymv/step_images"), self._autocast():
            return self.images_fn(self.model, samples, plan)

    def _plan(self, samples: Sequence[Sample]) -> list[list[int]]:
        if self.plan_fn is not None:
            return self.plan_fn(samples, self.config.micro_batch_tokens)
        lengths = [int(s["input_ids"].shape[0]) for s in samples]
        return plan_micro_batches(lengths, self.config.micro_batch_tokens)

    def global_counts(self, samples: Sequence[Sample]) -> GlobalCounts:
        tokens = sequences = 0.0
        for s in samples:  # host-side sums: one small copy to the device, not two kernels per sample
            m = s["loss_mask"] != 0
            tokens += float(m.sum())
            sequences += float(bool(m.any()))
        if not self.ranks.distributed:  # nothing to add up: no copy to the device and back
            return GlobalCounts(tokens=tokens, sequences=sequences)
        local = torch.tensor([tokens, sequences], dtype=torch.float64, device=self.device)
        self.ranks.sum_(local)
        return GlobalCounts(tokens=float(local[0]), sequences=float(local[1]))

    def train_step(self, samples: Sequence[Sample], loss_fn: LossFn) -> dict[str, float]:
        """Backward, gradient norm, clip and the optimizer step are queued without the host waiting on the
        device; one read at the end gets the losses, the norm, the non-finite flags and the metrics."""
        start = time.perf_counter()
        self.model.train()
        with record_function("gymv/plan"):
            counts = self.global_counts(samples)
            plan = self._plan(samples)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums: dict[str, Tensor] = {}
        maxes: dict[str, Tensor] = {}
        mins: dict[str, Tensor] = {}
        idle = self._micro_batches_to_match(len(plan))
        mb = None
        losses: list[Tensor] = []  # checked once after the step: a check per micro-batch waits on the device
        with self._step_weights():
            images = self._step_images(samples, plan)
            for n, indices in enumerate(plan):
                with record_function("gymv/collate"):  # named spans: a profiled step's timeline reads by phase
                    mb = _to_device(self.collate_fn([samples[i] for i in indices]), self.device)
                self._start_micro_batch(last=n == len(plan) - 1 and not idle)
                if images is not None:
                    images.last_micro_batch(n == len(plan) - 1)
                reads_step_images = images.active() if images is not None else contextlib.nullcontext()
                with record_function("gymv/forward"), reads_step_images:
                    logp, entropy, candidates = self._forward(mb)
                    extra = {"candidates": candidates} if candidates is not None else {}
                    loss, metrics = loss_fn(mb, logp, entropy, counts, **extra)
                with record_function("gymv/backward"):
                    loss.backward()  # a non-finite loss only spoils gradients that are then thrown away
                losses.append(loss.detach())
                loss_sum += loss.detach().double()
                for k, v in metrics.items():
                    v = torch.as_tensor(v, device=self.device).detach().double()
                    if k.endswith("_max"):
                        maxes[k] = torch.maximum(maxes[k], v) if k in maxes else v
                    elif k.endswith("_min"):
                        mins[k] = torch.minimum(mins[k], v) if k in mins else v
                    else:
                        sums[k] = sums.get(k, 0) + v
            for _ in range(idle):
                self._idle_pass(mb if mb is not None else self._empty_micro_batch(), backward=True)
        with record_function("gymv/optimizer"):
            self._sync_grads()
            norm = self._grad_norm()
            step_losses = torch.stack(losses).reshape(-1) if losses else torch.zeros(0, device=self.device)
            loss_bad = (~torch.isfinite(step_losses)).any()
            # [loss, norm]: 1 where a rank saw a non-finite value; every rank then cancels the same step
            flags = self.ranks.max_(torch.stack([loss_bad.float(), (~torch.isfinite(norm)).float().reshape(())]))
            self._clip_grads(norm)
            on_device = skips_on_device(self.optimizer)
            fresh = step_unless(self.optimizer, flags.max()) if on_device else []
        keys, reduced = self._reduce_metrics(loss_sum, float(len(plan)), sums, maxes, mins)
        with record_function("gymv/read"):
            read = torch.cat([flags.double(), norm.double().reshape(1), reduced, step_losses.double()]).tolist()
        loss_flag, norm_flag, grad_norm = read[0], read[1], read[2]
        values, local_losses = read[3 : 3 + len(keys)], read[3 + len(keys) :]
        if loss_flag or norm_flag:
            drop_fresh_state(self.optimizer, fresh)
            self.optimizer.zero_grad(set_to_none=True)
            raise self._non_finite(loss_flag > 0, grad_norm, local_losses, plan)
        if not on_device:
            with record_function("gymv/optimizer"):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        reads = dict(zip(keys, values))
        out = {"train/loss": reads.pop(_LOSS)}
        micro_batches = reads.pop(_MICRO_BATCHES)
        out.update({f"train/{k}": reads[k] for k in sorted(reads)})
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["train/num_tokens"] = counts.tokens
        out["train/num_sequences"] = counts.sequences
        out["train/num_micro_batches"] = micro_batches
        out[phase_key("train_step")] = time.perf_counter() - start  # the driver's PhaseTimer takes it
        return out

    def _non_finite(self, loss: bool, norm: float, losses: list[float], plan: list[list[int]]) -> GymvError:
        """The error of a cancelled step: the first non-finite loss of this rank, else another rank's, else the
        gradient norm."""
        where = f"train step {self.steps + 1} (rank {self.rank})"
        if not loss:
            return GymvError(f"non-finite gradient norm {norm}", where=where, exit_code=1,
                             fix="the step was not applied; lower the learning rate or check the loss inputs")
        first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        bad = (f"non-finite loss {losses[first]} in a micro-batch of {len(plan[first])} samples" if first is not None
               else "non-finite loss on another data-parallel rank")
        return GymvError(bad, where=where, exit_code=1, fix="the step was not applied; check rewards/advantages and "
                                                            "logprobs for inf/NaN, or lower the learning rate")

    def _clip_grads(self, norm: Tensor) -> None:
        """Scale gradients to `max_grad_norm`, on the device; a non-finite norm scales nothing."""
        if self.config.max_grad_norm is not None and self.config.max_grad_norm > 0 and any(p.grad is not None for p in self.params):
            self._scale_grads(norm)

    def _reduce_metrics(self, loss_sum: Tensor, micro_batches: float, sums: dict, maxes: dict,
                        mins: dict) -> tuple[list[str], Tensor]:
        """Names and cross-rank reductions (loss and micro-batch count first), still on the device: one
        collective per kind of reduction instead of one per metric."""
        keys = self.ranks.union_keys([*sums, *maxes, *mins])
        summed = [k for k in keys if not k.endswith(("_max", "_min"))]
        maxed = [k for k in keys if k.endswith("_max")]
        minned = [k for k in keys if k.endswith("_min")]

        def stacked(first: list[Tensor], names: list[str], got: dict, default: float) -> Tensor:
            fill = lambda: torch.full((), default, dtype=torch.float64, device=self.device)  # noqa: E731
            return torch.stack([*first, *(got[k].reshape(()) if k in got else fill() for k in names)])

        count = torch.full((), micro_batches, dtype=torch.float64, device=self.device)
        out = [self.ranks.sum_(stacked([loss_sum, count], summed, sums, 0.0))]
        if maxed:
            out.append(self.ranks.max_(stacked([], maxed, maxes, -math.inf)))
        if minned:
            out.append(self.ranks.min_(stacked([], minned, mins, math.inf)))
        return [_LOSS, _MICRO_BATCHES, *summed, *maxed, *minned], torch.cat(out)

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Sample]) -> list[Tensor]:
        was_training = self.model.training
        self.model.eval()
        out: list[Tensor | None] = [None] * len(samples)
        try:
            plan = self._plan(samples)
            idle = self._micro_batches_to_match(len(plan))
            mb = None
            for indices in plan:
                mb = _to_device(self.collate_fn([samples[i] for i in indices]), self.device)
                logp, _, _ = self._forward(mb)
                for row, i in enumerate(indices):
                    out[i] = logp[row, : samples[i]["input_ids"].shape[0]].cpu()
            for _ in range(idle):
                self._idle_pass(mb if mb is not None else self._empty_micro_batch(), backward=False)
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]

    def _empty_micro_batch(self) -> MicroBatch:
        """One token scored nowhere: the idle pass of a rank that got no samples at all."""
        one = {"input_ids": torch.zeros(1, dtype=torch.long), "loss_mask": torch.zeros(1, dtype=torch.bool)}
        return _to_device(self.collate_fn([one]), self.device)

    def state_dict(self) -> dict[str, Tensor]:
        """Detached model weights (the trainer's fp32 master copy), e.g. for refitting a generation backend."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def checkpoint_bytes(self) -> int:
        """About the bytes of this rank's weights and AdamW state in a checkpoint (local shards under FSDP2);
        before the first step, the state that step will create (two moments and a count per trainable weight)."""
        def size(t: Tensor) -> int:
            local = local_shard(t)
            return local.numel() * local.element_size()

        weights = {id(t): size(t) for t in self.model.state_dict().values()}  # tied weights once
        moment = 2 if self.config.optimizer_state_dtype == "bfloat16" else 4
        state = 0
        for p in self.params:
            kept = self.optimizer.state.get(p) if self.optimizer is not None else None
            if kept:
                state += sum(size(v) for v in kept.values() if isinstance(v, Tensor))
            else:
                state += 2 * local_shard(p).numel() * moment + 4  # and the float32 step count
        return sum(weights.values()) + state

    def save(self, path: str | os.PathLike) -> None:
        """Write model weights, optimizer state and the step count into directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if _st is not None:
            tmp = path / f".{MODEL_SAFETENSORS}.tmp"
            _st.save_model(self.model, str(tmp))
            _fsync_replace(tmp, path / MODEL_SAFETENSORS)
        else:  # pragma: no cover
            tmp = path / f".{MODEL_TORCH}.tmp"
            torch.save(self.model.state_dict(), tmp)
            _fsync_replace(tmp, path / MODEL_TORCH)
        tmp = path / f".{OPTIMIZER_FILE}.tmp"
        torch.save(self.optimizer.state_dict(), tmp)
        _fsync_replace(tmp, path / OPTIMIZER_FILE)
        tmp = path / f".{TRAINER_FILE}.tmp"
        tmp.write_text(json.dumps({"steps": self.steps, "config": self.config.model_dump(mode="json")}))
        _fsync_replace(tmp, path / TRAINER_FILE)

    def load(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if (path / MODEL_SAFETENSORS).exists() and _st is not None:
            missing, unexpected = _st.load_model(self.model, str(path / MODEL_SAFETENSORS), strict=False, device=str(self.device))
            if missing or unexpected:
                raise GymvError(
                    f"checkpoint does not match the model (missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})",
                    where=str(path / MODEL_SAFETENSORS), fix="load a checkpoint written by the same model architecture",
                )
        elif (path / MODEL_TORCH).exists():
            self.model.load_state_dict(torch.load(path / MODEL_TORCH, map_location=self.device, weights_only=True))
        else:
            raise GymvError("no model weights found", where=str(path), fix=f"expected {MODEL_SAFETENSORS} or {MODEL_TORCH}")
        opt_file = path / OPTIMIZER_FILE
        if not opt_file.exists():
            raise GymvError("no optimizer state found", where=str(path), fix=f"expected {OPTIMIZER_FILE}")
        self.optimizer.load_state_dict(torch.load(opt_file, map_location=self.device, weights_only=True))
        meta = path / TRAINER_FILE
        self.steps = int(json.loads(meta.read_text())["steps"]) if meta.exists() else 0
