"""The Megatron trainer under expert parallelism (training.parallel.expert > 1, Nemotron-H hybrid model).

The ranks of an EP group hold different samples, yet every MoE layer exchanges tokens among them
(megatron_ep.AllToAllDispatch), forward and backward: they must run the same number of passes. The trainer
is lock-step: a rank with fewer micro-batches than the busiest rank of the job adds idle passes (a forward
of its last micro-batch, or of one unscored token, with a zero loss whose backward still joins the
exchanges), so no sample is re-planned and the loss is unchanged.

Gradients: a dense weight (held whole, or TP-split, on every EP rank) is summed over the data-parallel
ranks (and the context-parallel ranks), as without EP; the router's is summed over TP too (each TP rank
dispatches its share of the tokens, HybridMoE). A routed expert is held whole by one EP rank of each EP
group (expert TP 1) and its gradient already covers every token the group sent it: it is summed over the
ranks holding the same experts, megatron's expert-data-parallel group (world / EP). The gradient norm
counts each expert once: its squares are summed over the EP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gymv.backends.training.megatron_hybrid_weights import EXPERT_SHARDED
from gymv.backends.training.megatron_tp import TensorParallelTrainer, tp_group
from gymv.backends.training.megatron_weights import tp_partial_gradient, tp_sharded
from gymv.backends.training.rank_reductions import RankReductions


def is_expert(name: str) -> bool:
    """A routed-expert weight of the hybrid model (split over EP ranks)."""
    return name.startswith("gpt.") and any(part in name for part in EXPERT_SHARDED)


class ExpertParallelTrainer(TensorParallelTrainer):
    """TensorParallelTrainer over an EP-split hybrid model: lock-step micro-batches, dense gradients summed
    over data (x context) ranks, expert gradients over `expert_dp_group`, expert norms over `ep_group`."""

    lockstep = True

    def __init__(self, *args: Any, ep_group, expert_dp_group, cp_group=None, **kwargs: Any):
        self.ep_group, self.cp_group = ep_group, cp_group
        self.expert_ranks = RankReductions(expert_dp_group)
        super().__init__(*args, **kwargs)

    def _split(self) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [(n, p) for n, p in named if not is_expert(n)], [(n, p) for n, p in named if is_expert(n)]

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if not self.ranks.distributed and not self.expert_ranks.distributed:
            return model
        with torch.no_grad():  # every replica starts from the first one's weights, experts from their holders'
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                ranks = self.expert_ranks if is_expert(name) else self.ranks
                if ranks.distributed:
                    dist.broadcast(t.data, src=ranks._global_rank0(), group=ranks.group)
        return model

    def _sync_grads(self) -> None:
        dense, experts = self._split()
        for _, p in dense + experts:  # a group of one reduces nothing, but every rank joins the others
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.ranks.sum_grads_([p for _, p in dense])
        if self.cp_group is not None:
            for _, p in dense:
                dist.all_reduce(p.grad, group=self.cp_group)
        self.expert_ranks.sum_grads_([p for _, p in experts])
        for name, p in dense:
            if tp_partial_gradient(name):
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=tp_group())

    def _grad_norm(self) -> Tensor:
        sharded = torch.zeros((), device=self.device, dtype=torch.float32)
        replicated = torch.zeros((), device=self.device, dtype=torch.float32)
        expert = torch.zeros((), device=self.device, dtype=torch.float32)
        for name, p in self.model.named_parameters():
            if p.grad is None or not p.requires_grad:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if is_expert(name):
                expert += sq
            elif name.startswith("gpt.") and tp_sharded(name):
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(expert, op=dist.ReduceOp.SUM, group=self.ep_group)  # every expert once, whole
        dist.all_reduce(sharded, op=dist.ReduceOp.SUM, group=tp_group())
        return (sharded + replicated + expert).sqrt()
