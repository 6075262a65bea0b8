"""Gathering a packed row's per-segment keys, with a backward that adds the copies of a shared prompt's keys
without atomic adds.

Where a GRPO group's prompt appears once in a packed row (gymv.backends.packing), each member's segment
attends to the prompt's keys, so the varlen kernel gets them once per member: `index_select` of the row's
keys by `index`. index_select's backward adds every gathered gradient back to its row position with
`index_add_`, which on CUDA is an atomic add per element; with a prompt's positions repeated once per member,
in bf16, those atomics cost more than the rest of the attention's bookkeeping. The layout is known on the
host when the row is packed, so `KeyGather.build` lists each position's copies there, once per row; the
backward then takes every position's first copy by one gather and adds each further copy by a gather and an
in-place add, copy after copy in the order they lie. No atomics, deterministic, and the sums are those of
index_add_ over the copies in order (what index_select's backward computes on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable


@dataclass
class KeyGather:
    """Where a packed row's gathered keys come from, and how their gradients add back."""

    index: torch.Tensor  # [Nk] long: the row position of each gathered key
    first: torch.Tensor  # [N] long: for each row position, where its first copy lies among the gathered keys
    repeated: torch.Tensor  # [D] long: the positions with more than one copy, most copies first
    copies: list[torch.Tensor]  # copies[r]: where the (r + 2)-th copies of repeated[:len(copies[r])] lie

    @classmethod
    def build(cls, index: torch.Tensor, n: int) -> KeyGather:
        """The plan for gathering rows `index` of an n-row tensor; every row must be gathered at least once."""
        index = index.detach().to("cpu", torch.long)
        counts = torch.bincount(index, minlength=n)
        if index.numel() and (int(index.min()) < 0 or counts.numel() != n) or bool((counts == 0).any()):
            raise ValueError(f"a key index must gather each of the {n} row positions at least once")
        order = torch.sort(index, stable=True).indices  # slots grouped by position, each group in slot order
        starts = torch.cumsum(counts, 0) - counts
        repeated = torch.sort(counts, descending=True, stable=True).indices[: int((counts > 1).sum())]
        held = counts[repeated]  # descending: the positions with more than r copies are a prefix
        copies = []
        for r in range(1, int(held[0]) if held.numel() else 1):
            rows = repeated[: int((held > r).sum())]
            copies.append(order[starts[rows] + r])
        return cls(index, order[starts], repeated, copies)

    def to(self, device) -> KeyGather:
        from gymv.backends.host_copy import to_device

        move = lambda t: to_device(t, device)  # noqa: E731
        return KeyGather(move(self.index), move(self.first), move(self.repeated), [move(c) for c in self.copies])


def gather(plan: KeyGather, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's rows `plan.index` (dim 0), as `index_select`; the backward adds copies without atomics."""
    return _Gather.apply(plan, *tensors)


def add_copies(plan: KeyGather, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the gathered rows, summed back onto the row positions they came from."""
    out = grad.index_select(0, plan.first)
    if plan.copies:
        acc = out.index_select(0, plan.repeated)
        for slots in plan.copies:
            acc[: slots.numel()].add_(grad.index_select(0, slots))
        out.index_copy_(0, plan.repeated, acc)
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
