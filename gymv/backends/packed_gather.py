"""Gathering a packed row's per-segment keys, with a backward that adds the copies of a shared prompt's keys
without atomic adds.

Where a GRPO group's prompt appears once in a packed row (gymv.backends.packing), each member's segment
attends to the prompt's keys, so the varlen kernel gets them once per member: `index_select` of the row's
keys by `index`. index_select's backward adds every gathered gradient back to its row position with
`index_add_`, which on CUDA is an atomic add per element; with a prompt's positions repeated once per member,
in bf16, those atomics cost more than the rest of the attention's bookkeeping. The layout is known on the
host when the row is packed, so `KeyGather.build` lists each position's copies there, once per row: the
backward takes every position's first copy by one gather, and for the positions held more than once, all
their copies by one gather per distinct number of copies (a GRPO row has one or two), summed over the copies
by one reduction (in float32 for 16-bit gradients). No atomics, deterministic, a handful of kernels per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from gymv.backends.host_copy import to_device


@dataclass
class KeyGather:
    """Where a packed row's gathered keys come from, and how their gradients add back."""

    index: torch.Tensor  # [Nk] long: the row position of each gathered key
    first: torch.Tensor  # [N] long: for each row position, where its first copy lies among the gathered keys
    repeated: torch.Tensor  # [D] long: the positions with more than one copy, most copies first
    tables: list[torch.Tensor]  # per number of copies c (descending): [c, D_c] where the copies of the next
    # D_c positions of `repeated` lie among the gathered keys

    @classmethod
    def build(cls, index: torch.Tensor, n: int) -> KeyGather:
        """The plan for gathering rows `index` of an n-row tensor; every row must be gathered at least once.
        Built with numpy: it runs on the host before every packed forward pass."""
        index = index.detach().to("cpu", torch.long)
        at = index.numpy()
        if at.size and (int(at.min()) < 0 or int(at.max()) >= n):
            raise ValueError(f"a key index must gather each of the {n} row positions at least once")
        counts = np.bincount(at, minlength=n)
        if counts.size != n or (counts == 0).any():
            raise ValueError(f"a key index must gather each of the {n} row positions at least once")
        order = np.argsort(at, kind="stable")  # slots grouped by position, each group in slot order
        starts = np.cumsum(counts) - counts
        many = np.flatnonzero(counts > 1)
        repeated = many[np.argsort(-counts[many], kind="stable")]  # most copies first, then by position
        held = counts[repeated]
        tables, done = [], 0
        for c in np.unique(held)[::-1]:
            rows = repeated[done:done + int(np.count_nonzero(held == c))]
            tables.append(torch.from_numpy(order[starts[rows][None, :] + np.arange(int(c))[:, None]]))
            done += rows.size
        return cls(index, torch.from_numpy(order[starts]), torch.from_numpy(repeated), tables)

    def to(self, device) -> KeyGather:
        move = lambda t: to_device(t, device)  # noqa: E731
        return KeyGather(move(self.index), move(self.first), move(self.repeated), [move(t) for t in self.tables])


def gather(plan: KeyGather, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's rows `plan.index` (dim 0), as `index_select`; the backward adds copies without atomics."""
    return _Gather.apply(plan, *tensors)


def add_copies(plan: KeyGather, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the gathered rows, summed back onto the row positions they came from."""
    out = grad.index_select(0, plan.first)
    if plan.tables and not grad.is_cuda:  # on the CPU, copy after copy: the sums of index_add_, bit for bit
        sums = []
        for t in plan.tables:
            acc = grad.index_select(0, t[0])
            for slots in t[1:]:
                acc.add_(grad.index_select(0, slots))
            sums.append(acc)
        out.index_copy_(0, plan.repeated, sums[0] if len(sums) == 1 else torch.cat(sums))
    elif plan.tables:
        sums = [grad.index_select(0, t.reshape(-1)).view(*t.shape, *grad.shape[1:]).sum(0) for t in plan.tables]
        out.index_copy_(0, plan.repeated, sums[0] if len(sums) == 1 else torch.cat(sums))
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: KeyGather, *tensors: torch.Tensor):
        ctx.plan = plan
        return tuple(t.index_select(0, plan.index) for t in tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        return (None, *(None if g is None else add_copies(ctx.plan, g) for g in grads))
