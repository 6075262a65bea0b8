"""What a multi-rank trainer adds up over its ranks besides what FSDP2 reduces: metric sums, maxima and minima,
the union of metric names, and the gradients of parameters every rank holds whole (fsdp2's replicated vision
tower and projector, megatron's data-parallel replicas).

Those gradients are summed once per step, after all micro-batches: each rank's loss is already divided by
GLOBAL counts, so the sum (not the mean) is the whole batch's gradient, whatever number of micro-batches each
rank ran. Works on gloo (CPU) and NCCL (GPU); with torch.distributed uninitialised (or a group of one) every
reduction returns its input.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_ELEMENTS = 1 << 25


class RankReductions:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1

    @property
    def distributed(self) -> bool:
        return self.active and self.world_size > 1

    def _global_rank0(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def sum_(self, t: Tensor) -> Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def max_(self, t: Tensor) -> Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def min_(self, t: Tensor) -> Tensor:
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t

    def union_keys(self, keys: Iterable[str]) -> list[str]:
        """Sorted union of metric names over ranks, so every rank reduces the same tensors in the same order."""
        mine = sorted(set(keys))
        if not self.distributed:
            return mine
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return sorted({k for ks in gathered for k in (ks or [])})

    def broadcast_module_(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's parameters and buffers."""
        if not self.distributed:
            return
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=self._global_rank0(), group=self.group)

    def sum_grads_(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the .grad of parameters held whole on every rank, in flat buckets; a missing grad counts as zeros."""
        if not self.distributed:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            bucket: list[torch.nn.Parameter] = []
            size = 0
            for p in group:
                bucket.append(p)
                size += p.grad.numel()
                if size >= BUCKET_ELEMENTS:
                    self._reduce_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: list[torch.nn.Parameter]) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
