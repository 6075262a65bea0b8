"""Context parallelism for gymv's Megatron hybrid model (Nemotron-H): each row's sequence split over the ranks
of a CP group, every layer computing on its own positions only.

Layout, as megatron-core balances causal work: a row of length L (padded up to a multiple of 2*CP) is cut
into 2*CP chunks and rank r holds chunks r and 2*CP-1-r, so every rank has as many early as late positions.

- Attention layers: each rank's queries attend to the keys and values of the whole row, gathered from every
  rank (an all-gather whose backward sums the key/value gradients over the group and keeps this rank's),
  under a mask built from the global positions: causal, and within a packed row's segment.
- Mamba-2 layers, as megatron-core's mamba_context_parallel: after the input projection an all-to-all turns
  sequence shards of all heads into the whole sequence of 1/CP of the heads (x, dt, and the B/C groups those
  heads read; a group is repeated when there are fewer groups than CP ranks), so the causal convolution and
  the scan see the whole sequence of their heads, segment starts included (no state crosses a segment);
  a second all-to-all returns the scan's output to sequence shards of all heads for the gated norm and
  the output projection. Collectives: all_gather, all_reduce and all_to_all_single with equal splits, all
  on gloo and NCCL.
- MoE and MLP layers are per token and need nothing (expert parallel dispatch takes any token count); the
  routers' load-balancing terms are summed over the group (gymv.backends.moe_router, through the wrapper's
  `router_replica`: the group and this rank's positions), so they are the whole rows'.
- The logits of a rank's positions are gathered over the group at the end (backward: each rank keeps the
  gradient of its own positions), so every CP rank sees the whole row's logits and computes the same loss;
  each rank's parameter gradients then cover its own positions and are summed over the CP group, as
  megatron sums them over data x context parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from gymv.backends import mamba_kernels, packed_attention
from gymv.backends.moe_router import RouterReplica
from gymv.backends.ssd_scan import chunk_scan, seq_idx_from_bounds
from gymv.backends.packing import PackedAttentionArgs
from gymv.backends.training.megatron_ep import all_to_all
from gymv.backends.training.megatron_hybrid import HybridModel, TorchMamba2Mixer, hybrid_config
from gymv.backends.training.megatron_hybrid_weights import HybridShape
from gymv.backends.training.megatron_model import MegatronCausalLM, MegatronVLM, SdpaCoreAttention
from gymv.backends.training.megatron_tp import TensorParallelTrainer
from gymv.errors import GymvError


@dataclass(frozen=True)
class ContextLayout:
    """Which positions of a row of `length` (a multiple of 2*cp) each CP rank holds."""

    length: int
    cp: int
    rank: int

    @staticmethod
    def padded(length: int, cp: int) -> int:
        return -(-length // (2 * cp)) * (2 * cp)

    def positions(self, rank: int | None = None) -> Tensor:
        r = self.rank if rank is None else rank
        c = self.length // (2 * self.cp)
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * self.cp - 1 - r) * c,
                                                                          (2 * self.cp - r) * c)])

    def natural(self) -> Tensor:
        """Index into every rank's positions laid end to end (rank order) that gives the row in order."""
        return torch.argsort(torch.cat([self.positions(r) for r in range(self.cp)]))

    def shard(self, x: Tensor, dim: int) -> Tensor:
        return x.index_select(dim, self.positions().to(x.device))


def _seq_idx(starts, batch: int, length: int, device) -> Tensor | None:
    """ssd_scan's sequence index of a row whose segments begin at `starts` (0 first); none for one segment."""
    if not starts or len(starts) == 1:
        return None
    return seq_idx_from_bounds([*starts, length], length, device).expand(batch, length).contiguous()


def _rank_blocks(x: Tensor, dim: int, group) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _Gather(torch.autograd.Function):
    """All ranks' blocks end to end. Backward: with `summed` the gradient is summed over the group first (every
    rank's own computation used every block); without, every rank repeated the same computation (megatron's
    gather-from-region rule). Either way each rank keeps its block."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group, summed: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.size, ctx.summed = dim, group, x.shape[dim], summed
        return _rank_blocks(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.summed:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.size, ctx.size), None, None, None


def gather_sequence(x: Tensor, layout: ContextLayout, group, dim: int, *, repeated: bool = False) -> Tensor:
    """The whole row from every rank's shard, in order along `dim`. `repeated`: what follows is computed
    identically on every rank (the loss), so each rank keeps its positions' gradient; otherwise each rank's
    use differs (keys and values) and the gradients are summed over the group."""
    return _Gather.apply(x, dim, group, not repeated).index_select(dim, layout.natural().to(x.device))


def _exchange(blocks: Tensor, group) -> Tensor:
    """blocks [cp, ...]: block j to rank j; returns [cp, ...], block i from rank i (differentiable)."""
    cp = blocks.shape[0]
    out = all_to_all(blocks.reshape(cp, -1), [1] * cp, [1] * cp, group)
    return out.view(blocks.shape)


def sequence_to_heads(x: Tensor, layout: ContextLayout, group) -> Tensor:
    """x [B, L/cp, cp, W] (this rank's positions; block j of the channels for rank j) -> [B, L, W]: the
    whole row of this rank's channel block."""
    blocks = _exchange(x.permute(2, 0, 1, 3).contiguous(), group)  # [cp source, B, L/cp, W]
    whole = blocks.permute(1, 0, 2, 3).reshape(x.shape[0], -1, x.shape[-1])  # source ranks' positions in turn
    return whole.index_select(1, layout.natural().to(x.device))


def heads_to_sequence(y: Tensor, layout: ContextLayout, group) -> Tensor:
    """y [B, L, W] (the whole row of this rank's channel block) -> [B, L/cp, cp * W]: this rank's positions
    with every rank's block, in rank order."""
    per_rank = torch.stack([y.index_select(1, layout.positions(r).to(y.device)) for r in range(layout.cp)])
    blocks = _exchange(per_rank, group)  # [cp source (= channel block), B, L/cp, W]
    return blocks.permute(1, 2, 0, 3).reshape(y.shape[0], -1, layout.cp * y.shape[-1])


def segment_ids(starts: Sequence[int] | None, length: int, device) -> Tensor:
    """Each position's segment (0 where there is one segment)."""
    if not starts:
        return torch.zeros(length, dtype=torch.long, device=device)
    return torch.searchsorted(torch.tensor(list(starts)[1:], device=device), torch.arange(length, device=device),
                              right=True)


@dataclass
class ContextParallel:
    """The CP group and, for the forward pass under way, the row's layout and segment starts (global
    positions): set by ContextParallelHybridModel, read by its attention and Mamba layers."""

    group: Any
    size: int
    rank: int
    layout: ContextLayout | None = None
    starts: list[int] | None = field(default=None)

    @classmethod
    def of(cls, group) -> ContextParallel:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))


def context_attention(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel, scale: float | None = None) -> Tensor:
    """q [B, heads, L/cp, d] at this rank's positions, k and v [B, kv heads, L/cp, d] -> [B, heads, L/cp, d]:
    causal attention over the whole row, within each segment."""
    layout = cp.layout
    k, v = (gather_sequence(t, layout, cp.group, dim=2) for t in (k, v))
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mine = layout.positions().to(q.device)
    every = torch.arange(layout.length, device=q.device)
    seg = segment_ids(cp.starts, layout.length, q.device)
    allowed = (every[None, :] <= mine[:, None]) & (seg[None, :] == seg[mine][:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


class ContextParallelCoreAttention(SdpaCoreAttention):
    """megatron's core-attention slot over a CP group (Nemotron-H attention has no rotary positions, so the
    queries and keys need nothing of their positions but the mask)."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self", *,
                 cp: ContextParallel, **kwargs: Any):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.cp = cp

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None, **_: Any) -> Tensor:
        sq, b = query.shape[:2]
        q, k, v = (t.to(value.dtype).permute(1, 2, 0, 3) for t in (query, key, value))
        if isinstance(attention_mask, PackedAttentionArgs):
            packed_attention.calls += 1  # the packed row's segments reached attention (packed_attention.check_reached)
        out = context_attention(q, k, v, self.cp, self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class ContextParallelMamba2Mixer(TorchMamba2Mixer):
    """gymv's torch Mamba-2 mixer over a CP group: in_proj on this rank's positions, then the all-to-all to
    the whole row of 1/CP of this TP rank's heads for the convolution and the scan, and back."""

    def __init__(self, shape: HybridShape, config, *, tp_group=None, cp: ContextParallel):
        super().__init__(shape, config, tp_group=tp_group)
        self.cp = cp
        n = cp.size
        if self.heads % n:
            raise GymvError(f"context parallel size {n} does not divide the Mamba heads of a TP rank ({self.heads})",
                            where="training.parallel.context",
                            fix=f"use a context parallel size that divides {self.heads}")
        if self.groups % n and n % self.groups:
            raise GymvError(f"context parallel size {n} and the Mamba groups of a TP rank ({self.groups}) do not "
                            f"divide one another", where="training.parallel.context",
                            fix="use a context parallel size that divides the groups or is a multiple of them")
        self.cp_heads = self.heads // n
        self.cp_groups = max(self.groups // n, 1)

    def _group_slice(self, j: int) -> slice:
        first = j * self.groups // self.cp.size if self.groups >= self.cp.size else j // (self.cp.size // self.groups)
        return slice(first, first + self.cp_groups)

    def _conv_rows(self) -> Tensor:
        """This CP rank's channels of the convolution (its heads' x, its groups' B and C)."""
        j, p, n = self.cp.rank, self.head_dim, self.state
        g = self._group_slice(j)
        x = torch.arange(j * self.cp_heads * p, (j + 1) * self.cp_heads * p)
        b = self.inner + torch.arange(g.start * n, g.stop * n)
        c = b + self.groups * n
        return torch.cat([x, b, c])

    def forward(self, hidden: Tensor, starts: Sequence[int] | None = None) -> Tensor:
        cp, layout = self.cp, self.cp.layout
        proj, _ = self.in_proj(hidden)
        proj = proj.transpose(0, 1)  # [B, L/cp, local projections]
        bsz, t = proj.shape[:2]
        gn = self.groups * self.state
        z, x, b, c, dt = proj.split([self.inner, self.inner, gn, gn, self.heads], dim=-1)
        n = cp.size

        def groups(m: Tensor) -> Tensor:  # [B, L/cp, G*N] -> [B, L/cp, cp, (G/cp or 1)*N]
            m = m.view(bsz, t, self.groups, self.state)
            if self.groups < n:
                m = m.repeat_interleave(n // self.groups, dim=2)
            return m.reshape(bsz, t, n, -1)

        blocks = torch.cat([x.reshape(bsz, t, n, -1), groups(b), groups(c), dt.reshape(bsz, t, n, -1)], dim=-1)
        whole = sequence_to_heads(blocks, layout, cp.group)  # [B, L, my block]
        gn_cp = self.cp_groups * self.state
        inner_cp = self.cp_heads * self.head_dim
        xbc, dt = whole.split([inner_cp + 2 * gn_cp, self.cp_heads], dim=-1)
        rows = self._conv_rows().to(xbc.device)
        bias = self.conv1d.bias.index_select(0, rows) if self.conv1d.bias is not None else None
        # the convolution on CUDA's kernels where they load (mamba_kernels.causal_conv), the scan on torch's
        xbc = mamba_kernels.causal_conv(mamba_kernels.load(xbc.device), xbc,
                                        self.conv1d.weight[:, 0].index_select(0, rows), bias,
                                        _seq_idx(starts, xbc.shape[0], xbc.shape[1], xbc.device), "silu")
        x, b, c = xbc.split([inner_cp, gn_cp, gn_cp], dim=-1)
        heads = slice(cp.rank * self.cp_heads, (cp.rank + 1) * self.cp_heads)
        dt = F.softplus(dt + self.dt_bias[heads].to(dt.dtype)).clamp(self.limit[0], self.limit[1])
        length = x.shape[1]
        y = chunk_scan(x.reshape(bsz, length, self.cp_heads, self.head_dim), dt.float(),
                       -torch.exp(self.A_log[heads].float()), b.reshape(bsz, length, self.cp_groups, self.state),
                       c.reshape(bsz, length, self.cp_groups, self.state), self.chunk, D=self.D[heads],
                       seq_idx=_seq_idx(starts, bsz, length, x.device)).to(torch.float32)
        y = heads_to_sequence(y.reshape(bsz, length, inner_cp), layout, cp.group)  # [B, L/cp, inner]
        y = self.norm(y, z)
        out, _ = self.out_proj(y.to(hidden.dtype).transpose(0, 1))
        return out


def cp_factories(cp: ContextParallel) -> dict:
    """HybridModel factories for the attention and Mamba layers over `cp`."""

    def mamba(shape, config, layer_number, *, tp_group=None, cp_group=None):
        return ContextParallelMamba2Mixer(shape, config, tp_group=tp_group, cp=cp)

    def attention(shape, config, layer_number, *, tp_group=None, cp_group=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module

        spec = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.self_attention
        spec.submodules.core_attention = ModuleSpec(module=ContextParallelCoreAttention, params={"cp": cp})
        return build_module(spec, config=config, layer_number=layer_number)

    return {"M": mamba, "*": attention}


class ContextParallelHybridModel(HybridModel):
    """HybridModel over a CP group: the row (padded to a multiple of 2*CP) is cut to this rank's positions
    before the first layer, and the head's logits of every rank are gathered back into the row."""

    def __init__(self, shape: HybridShape, config, *, cp: ContextParallel, groups: dict[str, Any] | None = None,
                 factories: dict | None = None):
        super().__init__(shape, config, groups=groups, factories={**cp_factories(cp), **(factories or {})})
        self.cp = cp

    def forward(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, attention_mask: Any = None,
                decoder_input: Tensor | None = None, **_: Any) -> Tensor:
        hidden = decoder_input if decoder_input is not None else \
            self.embedding.word_embeddings(input_ids).transpose(0, 1).contiguous()
        length = hidden.shape[0]
        padded = ContextLayout.padded(length, self.cp.size)
        if padded > length:  # trailing positions: causal attention and scans never let them reach a real one
            hidden = torch.cat([hidden, hidden.new_zeros((padded - length, *hidden.shape[1:]))])
        starts = None
        if isinstance(attention_mask, PackedAttentionArgs):
            if attention_mask.keys is not None:
                raise RuntimeError("a packed row with shared prompts reached a Mamba-2 layer (its segments would "
                                   "not start from the prompt's state)")
            cu = attention_mask.bounds[0] if attention_mask.bounds is not None else attention_mask.cu_q.tolist()
            starts = [int(v) for v in cu[:-1]]
        layout = ContextLayout(padded, self.cp.size, self.cp.rank)
        self.cp.layout, self.cp.starts = layout, starts
        hidden = layout.shard(hidden, 0)
        for layer in self.decoder.layers:
            hidden = layer(hidden, attention_mask, starts)
        hidden = self.decoder.final_norm(hidden)
        weight = self.embedding.word_embeddings.weight if self.shape.tied else None
        logits, _ = type(self.output_layer).forward(self.output_layer, hidden, weight=weight)  # every position
        logits = gather_sequence(logits, layout, self.cp.group, dim=0, repeated=True)[:length]
        return logits.transpose(0, 1).contiguous()


class ContextParallelCausalLM(MegatronCausalLM):
    """MegatronCausalLM over a ContextParallelHybridModel: the head runs at every position of each rank's
    shard, so `logits_to_keep` picks the kept positions from the gathered row."""

    def router_replica(self) -> RouterReplica:
        """Its routers see this rank's positions of each row (ContextLayout), TP ranks the same tokens."""
        cp = self.gpt.cp

        def positions(length: int) -> Tensor:
            return ContextLayout(ContextLayout.padded(length, cp.size), cp.size, cp.rank).positions()

        return replace(super().router_replica(), context_group=cp.group, positions=positions)

    def forward(self, *args: Any, logits_to_keep: int | Tensor | None = None, **kwargs: Any):
        out = super().forward(*args, logits_to_keep=None, **kwargs)
        if isinstance(logits_to_keep, Tensor):
            out.logits = out.logits.index_select(1, logits_to_keep.to(out.logits.device))
        elif logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out


class ContextParallelVLM(ContextParallelCausalLM, MegatronVLM):
    """MegatronVLM (the HF vision tower and projector feeding the decoder) over a ContextParallelHybridModel:
    the image features are computed whole on every CP rank and the row is split after them."""


class ContextParallelTrainer(TensorParallelTrainer):
    """The TP trainer for a replica whose TP x CP ranks train the same samples: counts and metrics over the
    data-parallel group (one rank per replica and TP x CP position: each replica's once), gradients summed
    over data x context ranks, since each CP rank's gradient covers its own positions."""

    def __init__(self, *args: Any, cp_group, **kwargs: Any):
        self.cp_group = cp_group
        super().__init__(*args, **kwargs)

    def _sync_grads(self) -> None:
        super()._sync_grads()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.cp_group)


def build_context_parallel_hybrid(hf_config: Any, shape: HybridShape, *, cp_group, tensor_parallel: int = 1,
                                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                                  groups: dict[str, Any] | None = None,
                                  factories: dict | None = None) -> ContextParallelHybridModel:
    """build_hybrid's model over `cp_group` (load its weights with the same mapping: CP ranks hold every
    weight whole)."""
    config = hybrid_config(shape, tensor_parallel=tensor_parallel, dtype=dtype, device=device)
    model = ContextParallelHybridModel(shape, config, cp=ContextParallel.of(cp_group), groups=groups,
                                       factories=factories)
    return model.to(device=device)

