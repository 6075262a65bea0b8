"""Nemotron-H (the hybrid Mamba-2 / attention / MoE decoder of Nemotron 3 Omni) as a Megatron-core model: the
HF layer pattern, one pre-norm residual block per letter, built from megatron-core's tensor-parallel pieces
(vocab-parallel embedding and head, column/row-parallel projections, its SelfAttention) and gymv's own
mixers where megatron-core's need CUDA kernels or compute something else than the HF model.

Why not megatron-core's MambaStack: it builds its final norm from Transformer Engine and its Mamba mixer from
`mamba_ssm` / `causal_conv1d` kernels, so it cannot run on a CPU; its MoE router has no group-limited sigmoid
top-k with a correction bias computed as transformers computes it. The modules here compute what
`NemotronHForCausalLM` computes, in the same order (float32 norms, a float32 scan and router), so TP ranks
on gloo match the HF model at tight tolerance.

Seam for expert and context parallelism: every mixer is built by a small factory of this module taking its
process groups -- `build_mamba(shape, config, *, tp_group, cp_group)`, `build_attention(shape, config,
layer_number, *, tp_group, cp_group)`, `build_moe(shape, config, *, tp_group, ep_group)` -- and
`HybridModel(..., factories=...)` takes replacements of them. `HybridMoE` splits into routing
(`HybridTopkRouter`, whole on every rank), the local experts (`HybridExperts`: the EP rank's block of experts,
each whole under EP, split over TP at EP 1) and a `dispatch` hook (`LocalDispatch`: every token to the
experts this rank holds, the single-EP-rank case) that an expert-parallel token exchange replaces.

Shapes: hidden states are [T, B, H] through the stack (megatron's layout); the MoE layer routes tokens in
batch-major order, as the HF router does, so gymv.backends.moe_router reads its padding mask alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from gymv.backends import mamba_kernels
from gymv.backends.mamba_prefix import PrefixPlan
from gymv.backends.packed_mamba import prompt_plan, segment_conv, segment_scan
from gymv.backends.packing import PackedAttentionArgs
from gymv.backends.ssd_scan import seq_idx_from_bounds
from gymv.backends.training.megatron_hybrid_weights import HybridShape, expert_tensor_size
from gymv.backends.training.megatron_model import SdpaCoreAttention, require_megatron


def hybrid_config(shape: HybridShape, *, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu"):
    """The TransformerConfig megatron-core's layers read (attention sizes, TP size, dtype, CPU init)."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    device = torch.device(device)
    return TransformerConfig(
        num_layers=len(shape.pattern), hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn or shape.hidden,
        add_bias_linear=False, add_qkv_bias=False, normalization="RMSNorm", layernorm_epsilon=shape.eps,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=device.type != "cuda", perform_initialization=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, attention_softmax_in_fp32=True, bf16=dtype == torch.bfloat16)


def _noinit(_: Tensor) -> None:
    """Weights are loaded from the HF checkpoint (gymv.backends.training.megatron_hybrid_weights)."""


class HybridRMSNorm(nn.Module):
    """RMSNorm in float32 (weight applied in float32, then cast back), as the HF block norms compute it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The Mamba-2 output norm: y * silu(z), RMS-normalised per group of `group_size` channels. A TP rank
    holds whole groups, so the norm needs no communication."""

    def __init__(self, size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        kernels = mamba_kernels.load(y.device)
        if kernels is not None and kernels.gated_norm is not None:  # one Triton pass each way on CUDA
            return kernels.gated_norm(y, self.weight, None, z=z, eps=self.eps, group_size=self.group_size,
                                      norm_before_gate=False)
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class TorchMamba2Mixer(nn.Module):
    """A Mamba-2 mixer on this TP rank's heads and groups: in_proj (column parallel; this rank's slices of
    z, x, B, C, dt), the depthwise causal convolution and the chunked SSD scan, the gated group norm,
    out_proj (row parallel: summed over TP). Convolution and scan are gymv's shared torch ones
    (gymv.backends.ssd_scan: one call over a packed row, restarting at each sequence), or on CUDA
    mamba_ssm's Triton scan with causal_conv1d where installed, else gymv's Triton convolution
    (gymv.backends.mamba_kernels.causal_conv), as the HF trainer's packed path runs them."""

    def __init__(self, shape: HybridShape, config, *, tp_group=None, cp_group=None):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("context parallelism is not wired into gymv's torch Mamba-2 mixer")
        tp = config.tensor_model_parallel_size
        self.heads, self.head_dim = shape.mamba_heads // tp, shape.mamba_head_dim
        self.groups, self.state = shape.groups // tp, shape.state
        self.inner = self.heads * self.head_dim
        self.chunk, self.limit = shape.chunk, shape.time_step_limit
        conv = self.inner + 2 * self.groups * self.state
        self.in_proj = ColumnParallelLinear(shape.hidden, 2 * shape.mamba_inner + 2 * shape.groups * shape.state
                                            + shape.mamba_heads, config=config, init_method=_noinit, bias=False,
                                            gather_output=False, tp_group=tp_group)
        dtype = config.params_dtype
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(conv, 1, shape.conv_kernel, dtype=dtype))
        self.conv1d.bias = nn.Parameter(torch.empty(conv, dtype=dtype)) if shape.conv_bias else None
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.norm = GatedRMSNorm(self.inner, shape.mamba_inner // shape.groups, shape.eps)
        self.out_proj = RowParallelLinear(shape.mamba_inner, shape.hidden, config=config, init_method=_noinit,
                                          bias=False, input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)

    def forward(self, hidden: Tensor, bounds: Sequence[int] | Tensor | None = None,
                prefixes: PrefixPlan | None = None) -> Tensor:
        """hidden [T, B, H] -> [T, B, H]; `bounds`: a packed row's cumulative segment starts (B == 1);
        `prefixes`: its segments that continue a shared prompt (gymv.backends.mamba_prefix)."""
        proj, _ = self.in_proj(hidden)
        proj = proj.transpose(0, 1)  # [B, T, local projections]
        bsz, t = proj.shape[:2]
        seq_idx = seq_idx_from_bounds(bounds, t, proj.device) if bounds is not None else None
        kernels = mamba_kernels.load(proj.device)
        gn = self.groups * self.state
        z, xbc, dt = proj.split([self.inner, self.inner + 2 * gn, self.heads], dim=-1)
        weight = self.conv1d.weight[:, 0]
        xbc = segment_conv(kernels, xbc, weight, self.conv1d.bias, seq_idx, "silu", prefixes)
        x, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        y = segment_scan(kernels, x.reshape(bsz, t, self.heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
                         b.reshape(bsz, t, self.groups, self.state), c.reshape(bsz, t, self.groups, self.state),
                         self.chunk, self.D, self.dt_bias, self.limit, seq_idx, prefixes)
        y = self.norm(y.reshape(bsz, t, self.inner), z)
        out, _ = self.out_proj(y.to(hidden.dtype).transpose(0, 1))
        return out


class HybridMLP(nn.Module):
    """A non-gated relu^2 MLP split over TP (up column parallel, down row parallel): the dense layer and the
    shared expert."""

    def __init__(self, hidden: int, width: int, config, *, tp_group=None):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        self.up_proj = ColumnParallelLinear(hidden, width, config=config, init_method=_noinit, bias=False,
                                            gather_output=False, tp_group=tp_group)
        self.down_proj = RowParallelLinear(width, hidden, config=config, init_method=_noinit, bias=False,
                                           input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.up_proj(x)
        out, _ = self.down_proj(F.relu(h).square())
        return out


class HybridTopkRouter(nn.Module):
    """Nemotron-H's router in float32: sigmoid scores; the choice adds `e_score_correction_bias` and keeps
    the best `topk_group` of `n_group` expert groups (each group scored by its two best experts); the weights
    are the chosen experts' plain scores, normalised when `norm_topk_prob`, times `routed_scaling_factor`.
    Returns (logits, weights, indices) over tokens, as gymv.backends.moe_router reads a router."""

    def __init__(self, shape: HybridShape):
        super().__init__()
        self.top_k, self.experts = shape.top_k, shape.experts
        self.n_group, self.topk_group = shape.n_group, shape.topk_group
        self.norm_topk_prob, self.scaling = shape.norm_topk_prob, shape.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(shape.experts, shape.hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(shape.experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.experts // self.n_group)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep[..., None].expand_as(grouped).reshape(choice.shape), float("-inf"))
        index = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, index


class HybridExperts(nn.Module):
    """This EP rank's block of routed experts (`first`, the global index of its first), each expert's width
    split over the expert-TP ranks (`expert_tensor_size`: TP at EP 1, else 1, experts whole): up_proj
    [experts, width/etp, H], down_proj [experts, H, width/etp]. `forward` returns the weighted expert outputs
    of the tokens routed here (a TP rank's partial sum where the experts are TP-split)."""

    def __init__(self, shape: HybridShape, config, *, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        tp = expert_tensor_size(config.tensor_model_parallel_size, ep_size)
        local = shape.experts // ep_size
        self.first, self.local = ep_rank * local, local
        dtype = config.params_dtype
        self.up_proj = nn.Parameter(torch.empty(local, shape.moe_ffn // tp, shape.hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(local, shape.hidden, shape.moe_ffn // tp, dtype=dtype))

    def forward(self, x: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        """x [T, H], index [T, k] (global expert ids, every one among this rank's: the dispatch sends a rank
        only its experts' rows), weights [T, k]. Through gymv.backends.moe_experts (sorted by expert on the
        device, grouped matrix products where they run, no host sync), as the HF trainer runs the experts."""
        from gymv.backends.moe_experts import experts

        return experts(x, index - self.first, weights, self.up_proj, self.down_proj, _relu2)


def _relu2(h: Tensor) -> Tensor:
    return F.relu(h).square()


class LocalDispatch:
    """One EP rank holding every expert: the tokens go to the local experts as they are. An expert-parallel
    exchange is a callable of the same signature (x, index, weights, experts) -> partial output."""

    def __call__(self, x: Tensor, index: Tensor, weights: Tensor, experts: HybridExperts) -> Tensor:
        return experts(x, index, weights)


def token_share(tokens: int, tp: int, rank: int) -> slice:
    """TP rank `rank`'s share of `tokens` rows: contiguous blocks of ceil(tokens / tp), the last ones shorter
    or empty where tp does not divide the count."""
    per = -(-tokens // tp)
    return slice(min(rank * per, tokens), min((rank + 1) * per, tokens))


class _GatherTokenShares(torch.autograd.Function):
    """Forward: every TP rank's share of the rows (`token_share`), all-gathered in rank order (each padded to
    the largest share, so a plain all-gather serves uneven counts). Backward: the gradient of the gathered
    rows is the same on every TP rank (the activations after the layer are replicated), so this rank keeps
    its own share's."""

    @staticmethod
    def forward(ctx, part: Tensor, tokens: int, group) -> Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.share = token_share(tokens, tp, rank)
        per = -(-tokens // tp)
        padded = part.new_zeros((per, *part.shape[1:]))
        padded[: part.shape[0]] = part
        parts = [torch.empty_like(padded) for _ in range(tp)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat(parts)[:tokens]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.share].contiguous(), None, None


class HybridMoE(nn.Module):
    """Routed experts plus the shared expert, as NemotronHMoE: out = sum_k w_k expert_k(x) + shared(x).

    The tokens enter through megatron's copy-to-TP-region (its backward sums the input's gradient over TP)
    and every TP rank routes all of them (the router is whole, its metrics see every token). Then:
    - EP 1, experts TP-split: every rank runs all tokens through its share of each expert's width and a TP
      all-reduce sums the partial outputs;
    - EP > 1, experts whole (expert TP 1, megatron's folding): the hidden states are replicated over TP (no
      sequence parallelism), so each TP rank dispatches only its share of the tokens (`token_share`, with
      their routing) to the EP group and the combined outputs are all-gathered over TP. Each TP rank's
      router gradient then covers its share's routing weights: the trainer sums it over TP, as it does
      where the experts are TP-split (megatron_hybrid_weights.TP_PARTIAL_GRADIENTS)."""

    def __init__(self, shape: HybridShape, config, *, tp_group=None, ep_group=None,
                 dispatch: Callable[..., Tensor] | None = None):
        super().__init__()
        ep_size = ep_group.size() if ep_group is not None else 1
        ep_rank = ep_group.rank() if ep_group is not None else 0
        self.tp_group = tp_group
        self.router = HybridTopkRouter(shape)
        self.experts = HybridExperts(shape, config, ep_size=ep_size, ep_rank=ep_rank)
        self.dispatch = dispatch or LocalDispatch()
        if ep_size > 1 and dispatch is None:
            raise NotImplementedError("expert parallelism needs a token dispatch (HybridMoE(dispatch=...))")
        self.shared_expert = (HybridMLP(shape.hidden, shape.shared_ffn, config, tp_group=tp_group)
                              if shape.shared_ffn else None)
        self.tp = config.tensor_model_parallel_size
        self.shares_tokens = self.tp > 1 and expert_tensor_size(self.tp, ep_size) == 1

    def forward(self, hidden: Tensor) -> Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        t, b, h = hidden.shape
        x = hidden.transpose(0, 1).reshape(-1, h)  # batch-major tokens, as the HF router sees them
        if self.tp > 1:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        _, weights, index = self.router(x)
        if self.shares_tokens:
            group = self.tp_group if self.tp_group is not None else parallel_state.get_tensor_model_parallel_group()
            mine = token_share(x.shape[0], self.tp, dist.get_rank(group))
            part = self.dispatch(x[mine], index[mine], weights[mine], self.experts)
            routed = _GatherTokenShares.apply(part, x.shape[0], group)
        else:
            routed = self.dispatch(x, index, weights, self.experts)
            if self.tp > 1:
                routed = reduce_from_tensor_model_parallel_region(routed, self.tp_group)
        out = routed.view(b, t, h).transpose(0, 1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden)
        return out


def build_mamba(shape: HybridShape, config, layer_number: int, *, tp_group=None, cp_group=None) -> nn.Module:
    return TorchMamba2Mixer(shape, config, tp_group=tp_group, cp_group=cp_group)


def build_attention(shape: HybridShape, config, layer_number: int, *, tp_group=None, cp_group=None) -> nn.Module:
    """megatron-core's SelfAttention (local spec: fused QKV column parallel, output row parallel) with gymv's
    SDPA core (causal; a packed row's segments apart). Nemotron-H attention has no rotary positions."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    if cp_group is not None and cp_group.size() > 1:
        raise NotImplementedError("context parallelism is not wired into gymv's hybrid attention")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.self_attention
    spec.submodules.core_attention = SdpaCoreAttention
    return build_module(spec, config=config, layer_number=layer_number)


def build_moe(shape: HybridShape, config, layer_number: int, *, tp_group=None, ep_group=None) -> nn.Module:
    return HybridMoE(shape, config, tp_group=tp_group, ep_group=ep_group)


def build_mlp(shape: HybridShape, config, layer_number: int, *, tp_group=None) -> nn.Module:
    return HybridMLP(shape.hidden, shape.ffn, config, tp_group=tp_group)


FACTORIES = {"M": build_mamba, "*": build_attention, "E": build_moe, "-": build_mlp}


class HybridLayer(nn.Module):
    """One block: hidden + mixer(norm(hidden))."""

    def __init__(self, kind: str, shape: HybridShape, mixer: nn.Module):
        super().__init__()
        self.kind = kind
        self.norm = HybridRMSNorm(shape.hidden, shape.eps)
        self.mixer = mixer

    def forward(self, hidden: Tensor, attention_mask: Any = None, bounds: Sequence[int] | Tensor | None = None,
                prefixes: PrefixPlan | None = None) -> Tensor:
        x = self.norm(hidden)
        if self.kind == "*":
            x, _ = self.mixer(x, attention_mask=attention_mask)
        elif self.kind == "M":
            # the context-parallel mixer takes no prompts (rows that reach it share none)
            x = self.mixer(x, bounds) if prefixes is None else self.mixer(x, bounds, prefixes)
        else:
            x = self.mixer(x)
        return hidden + x


class HybridModel(nn.Module):
    """The Nemotron-H decoder and head over this process's TP rank, with GPTModel's call and attribute
    names where gymv reaches into them (`embedding.word_embeddings`, `decoder.layers`, `output_layer`,
    `config`): forward(input_ids, position_ids, attention_mask, decoder_input) -> logits [B, T, V/tp].
    `attention_mask`: megatron's boolean mask, or a packed row's PackedAttentionArgs (its segments then
    also reach the Mamba layers). `groups`: process groups for the factories (tp, cp, ep)."""

    def __init__(self, shape: HybridShape, config, *, groups: dict[str, Any] | None = None,
                 factories: dict[str, Callable[..., nn.Module]] | None = None):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        self.shape, self.config = shape, config
        groups = groups or {}
        made = {**FACTORIES, **(factories or {})}
        tp = {"tp_group": groups.get("tp")}
        extra = {"M": {"cp_group": groups.get("cp")}, "*": {"cp_group": groups.get("cp")},
                 "E": {"ep_group": groups.get("ep")}, "-": {}}
        self.embedding = nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(shape.vocab, shape.hidden, init_method=_noinit,
                                                                config=config, tp_group=groups.get("tp"))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            HybridLayer(k, shape, made[k](shape, config, i + 1, **tp, **extra[k])) for i, k in enumerate(shape.pattern))
        self.decoder.final_norm = HybridRMSNorm(shape.hidden, shape.eps)
        self.output_layer = ColumnParallelLinear(shape.hidden, shape.vocab, config=config, init_method=_noinit,
                                                 bias=False, gather_output=False,
                                                 skip_weight_param_allocation=shape.tied, tp_group=groups.get("tp"))

    def forward(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None, attention_mask: Any = None,
                decoder_input: Tensor | None = None, **_: Any) -> Tensor:
        hidden = decoder_input if decoder_input is not None else \
            self.embedding.word_embeddings(input_ids).transpose(0, 1).contiguous()
        bounds = prefixes = None
        if isinstance(attention_mask, PackedAttentionArgs):
            # the host copy of the bounds where the batch has one (no device read per layer), else the device's
            bounds = attention_mask.bounds[0] if attention_mask.bounds is not None else attention_mask.cu_q
            if attention_mask.keys is not None:
                prefixes = prompt_plan(attention_mask, self.shape.conv_kernel, hidden.device)
        for layer in self.decoder.layers:
            hidden = layer(hidden, attention_mask, bounds, prefixes)
        hidden = self.decoder.final_norm(hidden)
        weight = self.embedding.word_embeddings.weight if self.shape.tied else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits.transpose(0, 1).contiguous()


def build_hybrid(hf_config: Any, shape: HybridShape, *, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", groups: dict[str, Any] | None = None,
                 factories: dict[str, Callable[..., nn.Module]] | None = None) -> HybridModel:
    """An uninitialised HybridModel of the HF decoder's shape (load its weights with the mapping)."""
    config = hybrid_config(shape, tensor_parallel=tensor_parallel, dtype=dtype, device=device)
    model = HybridModel(shape, config, groups=groups, factories=factories)
    return model.to(device=device)
