"""Megatron's data and tensor parallelism around the torch trainer.

Data parallel: every replica starts from rank 0's weights and the replicas' gradients are summed once per
step (gymv.backends.training.rank_reductions; megatron's own DDP wrapper allocates its buffers on CUDA only,
docs/training.md). What changes when a Megatron GPTModel is also split over TP ranks:

- The ranks of one TP group train one model replica, so they run the same samples: the union of what the
  driver handed each of them (gathered in TP rank order). Gradients are summed over the data-parallel
  group only (one rank per replica).
- Weights replicated on every TP rank whose gradient each rank holds only a share of (Qwen3's per-head
  q/k norms: each rank normalises its own heads) are summed over the TP group before the step.
- The gradient norm counts each sharded weight's pieces once per rank and each replicated weight once.
- Weights out (refit, checkpoint, export) are gathered from every TP rank, one decoder layer at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gymv.backends.training.megatron_weights import tp_partial_gradient, tp_sharded
from gymv.backends.training.torch_trainer import TorchTrainer


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def union_over_tp(samples: Sequence[Any], group=None) -> tuple[list[Any], slice]:
    """Every TP rank's samples (or every rank's of `group`: a replica's TP x CP ranks), in rank order, and
    where this rank's own sit in that list."""
    group = group if group is not None else tp_group()
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, list(samples), group=group)
    me = dist.get_rank(group)
    start = sum(len(p) for p in parts[:me])
    return [s for p in parts for s in p], slice(start, start + len(parts[me]))


def gather_state(state: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every TP rank's version of `state` (same keys and shapes on every rank, rank order)."""
    group = tp_group()
    out: list[dict[str, Tensor]] = [{} for _ in range(dist.get_world_size(group))]
    for name, t in state.items():
        parts = [torch.empty_like(t) for _ in out]
        dist.all_gather(parts, t.contiguous(), group=group)
        for shard, part in zip(out, parts):
            shard[name] = part
    return out


class ReplicaTrainer(TorchTrainer):
    """TorchTrainer over megatron's data-parallel replicas (`process_group`, default: every rank)."""

    multi_rank = True
    copies_weights = False  # megatron's layers: training.weight_copy is the torch backend's

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super()._place(model)
        self.ranks.broadcast_module_(model)
        return model

    def _sync_grads(self) -> None:
        self.ranks.sum_grads_(self.params)


class TensorParallelTrainer(ReplicaTrainer):
    """TorchTrainer over a TP-split GPTModel: data parallel over `process_group` (megatron's DP group). The TP
    ranks of a replica hold the same samples, hence the same micro-batch plan: their collectives pair up."""

    def _sync_grads(self) -> None:
        super()._sync_grads()
        for name, p in self.model.named_parameters():
            if p.grad is not None and tp_partial_gradient(name):
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=tp_group())

    def _grad_norm(self) -> Tensor:
        sharded = torch.zeros((), device=self.device, dtype=torch.float32)
        replicated = torch.zeros((), device=self.device, dtype=torch.float32)
        for name, p in self.model.named_parameters():
            if p.grad is None or not p.requires_grad:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if name.startswith("gpt.") and tp_sharded(name):  # vision towers stay whole on every rank
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(sharded, op=dist.ReduceOp.SUM, group=tp_group())
        return (sharded + replicated).sqrt()
