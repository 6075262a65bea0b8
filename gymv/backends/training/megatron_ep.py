"""Expert parallelism for Nemotron-H's MoE layers: the routed experts split over the ranks of an EP group, each
token sent to the rank that holds its expert and its output sent back, forward and backward.

Routing is HF's NemotronH router, unchanged (`route`): sigmoid scores, the score-correction bias used for
the choice only, group-limited top k, `norm_topk_prob`, `routed_scaling_factor`. The router and the shared
expert are replicated on every EP rank (each computes them for its own tokens); only the routed experts are
split, rank r holding experts `[r * E/ep, (r + 1) * E/ep)`, as megatron-core lays them out.

The exchange is two all-to-alls per layer (tokens out, expert outputs back) of uneven sizes, the shape of
megatron-core's alltoall token dispatcher. megatron-core's own dispatchers are not used: both allocate on the
CUDA device (the alltoall one creates a CUDA stream when built, the allgather one gathers into
`torch.cuda.current_device()` buffers), so neither runs on a CPU host. The collective they need does run on
gloo (`all_to_all_single` with uneven splits), and the same code runs on NCCL. The routing weights never
travel: a token's rank weighs the outputs it gets back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gymv.errors import GymvError


def route(hidden: Tensor, weight: Tensor, bias: Tensor, *, top_k: int, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """(top-k expert indices [T, k], their weights [T, k], float32) as HF's NemotronHTopkRouter picks them."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + bias
    experts = weight.shape[0]
    if n_group > 1:
        group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
    index = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return index, weights * scaling


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient goes back by the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group=None) -> Tensor:
    """Rows `x[sum(in_splits[:j]) : ...]` go to rank j; the result holds rank i's rows at `out_splits[i]`."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


class AllToAllDispatch:
    """The expert-parallel token exchange: `(hidden [T, H], index [T, k], weights [T, k], experts) -> [T, H]`,
    the weighted sum of each token's experts' outputs. `experts` is this rank's block of experts (global
    indices `[rank * E/ep, (rank + 1) * E/ep)`), called as HF's NemotronHExperts on the rows it receives,
    one expert per row with weight 1 (a TP rank's experts may return partial sums: the caller reduces them).
    Every rank of `group` calls it together (the same layers, in the same order), ranks with no tokens too."""

    def __init__(self, num_experts: int, group=None):
        self.group = group
        self.ep = dist.get_world_size(group) if dist.is_initialized() else 1
        if num_experts % self.ep:
            raise GymvError(f"{num_experts} routed experts do not split over {self.ep} expert-parallel ranks",
                            where="training.parallel.expert", fix="use an expert parallel size that divides it")
        self.num_experts, self.local = num_experts, num_experts // self.ep
        self.first = (dist.get_rank(group) if self.ep > 1 else 0) * self.local

    def __call__(self, hidden: Tensor, index: Tensor, weights: Tensor, experts) -> Tensor:
        tokens, k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = torch.arange(tokens, device=hidden.device).repeat_interleave(k)[order]
        x = hidden[token_of]
        ids = flat[order]
        if self.ep > 1:
            per_expert = torch.bincount(flat, minlength=self.num_experts)
            got = torch.empty_like(per_expert)  # per source rank, the rows each of my experts gets from it
            dist.all_to_all_single(got, per_expert, group=self.group)
            send = per_expert.view(self.ep, self.local).sum(1).tolist()
            recv = got.view(self.ep, self.local).sum(1).tolist()
            x = all_to_all(x, recv, send, self.group)
            ids = self.first + torch.arange(self.local, device=x.device).repeat(self.ep).repeat_interleave(got)
        y = experts(x, ids[:, None], torch.ones_like(ids[:, None], dtype=weights.dtype))
        if isinstance(experts, nn.Module):
            # rows for none of this rank's experts: the output still depends on the received rows and on the
            # weights, so this rank's backward joins both exchanges and its gradients are zeros, not None
            y = y + 0 * x + 0 * sum(p.sum() for p in experts.parameters())
        if self.ep > 1:
            y = all_to_all(y, send, recv, self.group)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return hidden.new_zeros(hidden.shape).index_add(0, token_of, y.to(hidden.dtype))


class ExpertParallelExperts(nn.Module):
    """This rank's block of the routed experts (HF's `experts.up_proj` [E, I, H] and `down_proj` [E, H, I],
    rows `first:first + local`), called as HF's NemotronHExperts: `(hidden [T, H], index [T, k],
    weights [T, k]) -> [T, H]`, through `AllToAllDispatch` over `group`."""

    def __init__(self, up_proj: Tensor, down_proj: Tensor, *, num_experts: int, group=None, act=relu2):
        super().__init__()
        self.dispatch = AllToAllDispatch(num_experts, group)
        self.first, self.local = self.dispatch.first, self.dispatch.local
        if up_proj.shape[0] != self.local or down_proj.shape[0] != self.local:
            raise ValueError(f"expected {self.local} local experts, got {up_proj.shape[0]} and {down_proj.shape[0]}")
        self.up_proj = nn.Parameter(up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act = act

    @classmethod
    def from_full(cls, up_proj: Tensor, down_proj: Tensor, *, group=None, act=relu2) -> ExpertParallelExperts:
        """This rank's rows of the full [E, ...] expert tensors (copies, so the full ones can be freed)."""
        ep = dist.get_world_size(group) if dist.is_initialized() else 1
        n = up_proj.shape[0]
        rows = expert_rows(n, ep, dist.get_rank(group) if ep > 1 else 0) if n % ep == 0 else slice(None)
        return cls(up_proj[rows].detach().clone(), down_proj[rows].detach().clone(), num_experts=n, group=group,
                   act=act)

    def local_experts(self, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """HF's expert loop over this rank's experts alone (indices are global)."""
        out = torch.zeros_like(x)
        for e in range(self.local):
            token, slot = torch.where(index == self.first + e)
            if token.numel():
                y = F.linear(self.act(F.linear(x[token], self.up_proj[e])), self.down_proj[e])
                out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        return self.dispatch(hidden, index, weights, self._local)

    def _local(self, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        y = self.local_experts(x, index, weights)
        return y + 0 * x + 0 * (self.up_proj.sum() + self.down_proj.sum())  # see AllToAllDispatch


class ExpertParallelMoE(nn.Module):
    """HF's NemotronHMoE with its routed experts split over `group`: the router (`gate`), the shared expert and
    the latent projections stay whole on every rank, under HF's names, so a state dict differs from HF's
    only in the rows of `experts.up_proj` and `experts.down_proj` (see `expert_rows`)."""

    def __init__(self, moe: nn.Module, *, group=None):
        super().__init__()
        cfg = moe.gate
        self.top_k, self.n_group, self.topk_group = cfg.top_k, cfg.num_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.fc1_latent_proj, self.fc2_latent_proj = moe.fc1_latent_proj, moe.fc2_latent_proj
        self.experts = ExpertParallelExperts.from_full(moe.experts.up_proj, moe.experts.down_proj, group=group,
                                                       act=moe.experts.act_fn)

    def forward(self, hidden: Tensor) -> Tensor:
        shape = hidden.shape
        index, weights = route(hidden, self.gate.weight, self.gate.e_score_correction_bias, top_k=self.top_k,
                               n_group=self.n_group, topk_group=self.topk_group,
                               norm_topk_prob=self.norm_topk_prob, scaling=self.scaling)
        flat = self.fc1_latent_proj(hidden.reshape(-1, shape[-1]))
        routed = self.fc2_latent_proj(self.experts(flat, index, weights))
        return routed.view(shape) + self.shared_experts(hidden)


def expert_rows(num_experts: int, ep_size: int, ep_rank: int) -> slice:
    """The rows of the [E, ...] expert tensors that EP rank `ep_rank` holds."""
    local = num_experts // ep_size
    return slice(ep_rank * local, (ep_rank + 1) * local)
