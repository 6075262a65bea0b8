"""The static decoder's layers for Nemotron-H hybrids (Nemotron 3 Nano/Super Omni's language model).

A Nemotron-H block is one pre-normed mixer with a residual: a Mamba-2 mixer, attention without rotary
positions, a mixture of experts (sigmoid router with a score-correction bias and group-limited top-k,
non-gated experts, a shared expert) or a plain MLP. Decoding one token per row, a Mamba layer keeps two
fixed-size states per row instead of a growing KV cache: the convolution's last `conv_kernel` inputs and the
SSM state [heads, head dim, state size]. The functions below compute what transformers' own single-token
path computes (the PyTorch reference of `causal_conv1d_update` and `selective_state_update`, the router of
`NemotronHTopkRouter`), reading the model's parameters, with every shape fixed so that a CUDA graph can
replay them. The experts run either grouped (`torch.nn.functional.grouped_mm` over the token-expert pairs
sorted by expert, gymv.backends.moe_experts, as in training: only the chosen experts' weights are read) or
dense (every expert on every row, weighted by the router; no grouped kernel needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gymv.backends import moe_experts

KINDS = {"linear_attention": "mamba", "full_attention": "attention", "moe": "moe", "mlp": "mlp",
         "mamba": "mamba", "attention": "attention"}  # the block types' names in transformers 5.x, older and newer
MOE_KERNELS = ("auto", "grouped", "dense")


@dataclass(frozen=True)
class MambaShape:
    heads: int
    head_dim: int
    state: int
    groups: int
    kernel: int
    eps: float  # the gated norm's

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


@dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk: bool
    scale: float


def decoder(model) -> Any:
    """The Nemotron-H decoder (embeddings, layers, norm_f) inside a causal LM or an Omni model, or None."""
    for owner in (getattr(model, "language_model", None), model):
        inner = getattr(owner, "model", None)
        if inner is not None and all(hasattr(inner, a) for a in ("embeddings", "layers", "norm_f")) \
                and hasattr(inner.layers[0], "mixer"):
            return inner
    return None


def unsupported(lm) -> str | None:
    """Why the static decoder cannot run this Nemotron-H decoder, or None."""
    cfg = lm.config
    kinds = [getattr(layer, "block_type", None) for layer in lm.layers]
    odd = sorted({str(k) for k in kinds if k not in KINDS})
    if odd:
        return f"Nemotron-H layer types {', '.join(odd)}"
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "attention_bias", False):
        return "attention with biases"
    moe = next((layer.mixer for layer in lm.layers if KINDS[layer.block_type] == "moe"), None)
    if moe is not None and not isinstance(getattr(moe.experts, "up_proj", None), torch.nn.Parameter):
        return "experts stored one module each (this transformers predates fused expert tensors)"
    return None


def shapes(lm) -> tuple[tuple[str, ...], MambaShape, MoeShape]:
    cfg = lm.config
    kinds = tuple(KINDS[layer.block_type] for layer in lm.layers)
    mamba = MambaShape(heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, state=cfg.ssm_state_size,
                       groups=cfg.n_groups, kernel=cfg.conv_kernel, eps=float(cfg.layer_norm_epsilon))
    moe = MoeShape(experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                   topk_group=cfg.topk_group, norm_topk=bool(cfg.norm_topk_prob),
                   scale=float(cfg.routed_scaling_factor))
    return kinds, mamba, moe


def layer_tensors(kind: str, layer, join) -> tuple:
    """The tensors one decode step of `layer` reads (after its kind, which `_forward_token` dispatches on);
    `join` makes one tensor (or a list to concatenate) of q/k/v."""
    m = layer.mixer
    ln = layer.norm.weight
    if kind == "attention":
        return (ln, join([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]), None, None, None,
                m.o_proj.weight, m.o_proj.bias)
    if kind == "mamba":
        return (ln, m.in_proj.weight, m.in_proj.bias, m.conv1d.weight, m.conv1d.bias, m.dt_bias, m.A_log, m.D,
                m.norm.weight, m.out_proj.weight, m.out_proj.bias)
    if kind == "moe":
        latent = getattr(m.fc1_latent_proj, "weight", None), getattr(m.fc2_latent_proj, "weight", None)
        return (ln, m.gate.weight, m.gate.e_score_correction_bias, m.experts.up_proj, m.experts.down_proj,
                m.shared_experts.up_proj.weight, m.shared_experts.down_proj.weight, *latent)
    return ln, m.up_proj.weight, m.down_proj.weight


def activation(kind: str, layer):
    """The MLP activation of an MoE or MLP layer (relu² in Nemotron-H); the others have none to choose."""
    m = layer.mixer
    return m.experts.act_fn if kind == "moe" else getattr(m, "act_fn", None)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Nemotron-H's RMSNorm: normalised and scaled in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def mamba_in(x, conv_state, ln, w_in, b_in, conv_w, conv_b, *, shape: MambaShape, eps: float) -> tuple:
    """A Mamba-2 block up to its SSM update, one token per row: (x [B, H, P], dt [B, H], B and C [B, G, N],
    gate); the convolution's state updated in place."""
    B, s = x.shape[0], shape
    proj = F.linear(rms(x, ln, eps), w_in, b_in)
    gate, xbc, dt = proj.split([s.inner, s.conv_dim, s.heads], dim=-1)
    window = torch.cat([conv_state[:, :, 1:], xbc.transpose(1, 2).to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window)
    xbc = F.silu(F.conv1d(window.to(conv_w.dtype), conv_w, conv_b, groups=s.conv_dim)).to(x.dtype).transpose(1, 2)
    xs, b, c = xbc.split([s.inner, s.groups * s.state, s.groups * s.state], dim=-1)
    return (xs.reshape(B, s.heads, s.head_dim), dt[:, 0], b.reshape(B, s.groups, s.state),
            c.reshape(B, s.groups, s.state), gate)


def mamba_out(x, y, gate, norm_w, w_out, b_out, *, shape: MambaShape):
    """The rest of the block after the SSM update `y` [B, H, P]: gated norm, output projection, residual."""
    return x + F.linear(_gated_norm(y.reshape(x.shape[0], 1, shape.inner), gate, norm_w, shape).to(x.dtype), w_out,
                        b_out)


def mamba_step(x, conv_state, ssm_state, ln, w_in, b_in, conv_w, conv_b, dt_bias, a_log, d, norm_w, w_out, b_out, *,
               shape: MambaShape, eps: float, ssm_update=None, stages=(mamba_in, mamba_out)):
    """One token per row through a Mamba-2 block (norm, mixer, residual); updates both states in place.
    `ssm_update`: the SSM state's one-token update (`ssm_update_torch` when None, or `ssm_update_triton`);
    `stages`: `mamba_in` and `mamba_out` or their compiled forms (the update between them stays a kernel of
    its own)."""
    first, last = stages
    xs, dt, b, c, gate = first(x, conv_state, ln, w_in, b_in, conv_w, conv_b, shape=shape, eps=eps)
    y = (ssm_update or ssm_update_torch)(ssm_state, xs, dt, a_log, b, c, d, dt_bias)
    return last(x, y, gate, norm_w, w_out, b_out, shape=shape)


def ssm_update_torch(state, x, dt, a_log, b, c, d, dt_bias):
    """The Mamba-2 SSM state after one token (updated in place) and its output [B, H, P] with the D skip, as
    transformers' torch `selective_state_update` computes them: state [B, H, P, N], x [B, H, P], dt [B, H]
    (before `dt_bias` and softplus), b and c [B, G, N]."""
    B, H, P = x.shape
    G, N = b.shape[1], b.shape[2]
    dt = F.softplus(dt[..., None].expand(-1, -1, P) + dt_bias[:, None].to(dt.dtype))[..., None]
    a = -torch.exp(a_log.float())[:, None, None]
    b = b.reshape(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, 1, N)
    c = c.reshape(B, G, 1, N).expand(B, G, H // G, N).reshape(B, H, N)
    new = state * torch.exp(dt.float() * a) + dt * b * x[..., None]
    state.copy_(new.to(state.dtype))
    y = torch.bmm(new.to(c.dtype).view(B * H, P, N), c.reshape(B * H, N, 1)).view(B, H, P)
    return (y + x * d[:, None]).to(y.dtype).to(x.dtype)


def ssm_update_triton(state_update):
    """`ssm_update_torch` through mamba_ssm's Triton `selective_state_update` (gymv.backends.mamba_kernels):
    one kernel per layer and step, which a CUDA graph captures like any other."""
    def update(state, x, dt, a_log, b, c, d, dt_bias):
        H, P, N = x.shape[1], x.shape[2], state.shape[-1]
        a = -torch.exp(a_log.float())[:, None, None].expand(H, P, N)
        return state_update(state, x, dt[..., None].expand(-1, -1, P), a, b, c, d[:, None].expand(H, P),
                            z=None, dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True)
    return update


def _gated_norm(y, gate, weight, s: MambaShape):
    """Nemotron-H's gated RMSNorm: y * silu(gate), normalised per group of `inner / groups` channels."""
    h = y.float() * F.silu(gate.float())
    h = h.view(*h.shape[:-1], s.groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + s.eps)
    return weight * h.view(*y.shape).to(y.dtype)


def route(h, weight, correction, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], weights [T, k] float32): sigmoid scores, top experts of the top groups after the
    correction bias, weights from the uncorrected scores, normalised and scaled."""
    s = shape
    scores = F.linear(h.float(), weight.float()).sigmoid()
    choice = scores + correction
    if s.n_group > 1:
        per = s.experts // s.n_group
        top = choice.view(-1, s.n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(top, k=s.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(top).scatter_(1, groups, 1).unsqueeze(-1).expand(-1, s.n_group, per)
        choice = choice.masked_fill(~keep.reshape(-1, s.experts).bool(), float("-inf"))
    ids = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if s.norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * s.scale


def experts_grouped(h, ids, w, up, down, act):
    """The chosen experts of each row, as grouped matrix products over the (row, expert) pairs sorted by expert:
    the trainer's experts path (gymv.backends.moe_experts), with no host sync inside the CUDA graph."""
    return moe_experts.experts(h, ids, w, up, down, act, grouped=True)


def experts_dense(h, ids, w, up, down, act):
    """Every expert on every row, each weighted by the router (zero for experts not chosen): no grouped
    kernel and no data-dependent shape, at the price of reading every expert's weights."""
    full = torch.zeros(h.shape[0], up.shape[0], dtype=w.dtype, device=h.device).scatter_(1, ids, w)
    hidden = act(torch.einsum("th,eih->eti", h, up))
    out = torch.bmm(hidden, down.transpose(1, 2))  # [E, T, H]
    return (out * full.t()[..., None]).sum(dim=0).to(h.dtype)


def moe_in(x, ln, router, correction, latent_in, *, shape: MoeShape, eps: float) -> tuple:
    """A mixture-of-experts block up to its routed experts: (normed rows [B, 1, D], the experts' input rows,
    expert ids, weights)."""
    h = rms(x, ln, eps)
    flat = h.view(-1, h.shape[-1])
    ids, w = route(flat, router, correction, shape)
    return h, (flat if latent_in is None else F.linear(flat, latent_in)), ids, w


def moe_out(x, h, z, shared_up, shared_down, latent_out, *, act):
    """The rest of the block after the routed experts' sum `z`: the shared expert and the residual."""
    if latent_out is not None:
        z = F.linear(z, latent_out)
    return x + (z.view(h.shape) + F.linear(act(F.linear(h, shared_up)), shared_down))


def moe_step(x, ln, router, correction, up, down, shared_up, shared_down, latent_in, latent_out, *, shape: MoeShape,
             act, grouped: bool, eps: float, stages=(moe_in, moe_out)):
    """One token per row through a mixture-of-experts block (norm, routed and shared experts, residual).
    `stages`: `moe_in` and `moe_out` or their compiled forms (the grouped experts between them run as they are)."""
    first, last = stages
    h, z, ids, w = first(x, ln, router, correction, latent_in, shape=shape, eps=eps)
    z = (experts_grouped if grouped else experts_dense)(z, ids, w, up, down, act)
    return last(x, h, z, shared_up, shared_down, latent_out, act=act)


def mlp_step(x, ln, up, down, *, act, eps: float):
    return x + F.linear(act(F.linear(rms(x, ln, eps), up)), down)


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped experts kernel runs here: CUDA (sm80+) in bfloat16, where transformers uses it too."""
    has = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return has and device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
