"""Mamba-2 layers over packed rows: every sequence of the row starts from a zero state, in one call per row.

A Mamba-2 mixer runs through its input in order, carrying a convolution window and an SSM state, so over a
packed row each sequence would start from the state the one before it left. transformers' NemotronH mixer
takes no segment boundaries on its torch path, so `install` wraps each mixer of the model: in a packed
forward (the row's segments arrive as gymv's packed-attention keyword, which transformers hands to every
layer) the mixer runs as `mixer_forward` over the whole row with the row's sequence index (`seq_idx`):
projections, a causal convolution whose windows stop at each sequence's start, the chunked SSD scan whose
state restarts there, the gated norm and the output projection, with the mixer's own parameters. Any other
call (padded batches, generation with a cache) is the mixer's own.

The scan and the gated norm run on `mamba_ssm`'s Triton kernels on CUDA when they import
(gymv.backends.mamba_kernels; the convolution on `causal_conv1d` when installed, else on gymv's Triton
kernel, gymv.backends.conv_kernel), else on gymv's torch scan and convolution (gymv.backends.ssd_scan), which
are the reference the kernels are tested against and the path on CPU.
A segment that continues a shared prompt (a GRPO group's prompt held once in the row, gymv.backends.packing)
starts from the prompt's final convolution window and state: the row runs with every segment from zero and
gymv.backends.mamba_prefix adds the prompt's part, exactly (the recurrences are linear in it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gymv.backends import mamba_kernels, mamba_prefix
from gymv.backends.packed_attention import KEYWORD
from gymv.backends.ssd_scan import chunk_scan, seq_idx_from_bounds

MIXERS = ("NemotronHMamba2Mixer",)  # wrapped here: one call per packed row, with its sequence index
# take a packed row's segment bounds themselves (gymv's Megatron hybrid model, over gymv.backends.ssd_scan)
SEGMENT_AWARE = ("TorchMamba2Mixer", "ContextParallelMamba2Mixer")
# start a segment from a shared prompt's state (gymv.backends.mamba_prefix); the context-parallel mixer does not
CONTINUES = ("NemotronHMamba2Mixer", "TorchMamba2Mixer")


def mixers(model) -> list:
    """The Mamba-2 mixers of `model` that restart at each packed sequence (wrapped or on their own)."""
    return [m for m in model.modules() if type(m).__name__ in MIXERS + SEGMENT_AWARE]


def continues_prompts(model) -> bool:
    """Every Mamba-2 mixer of `model` can start a packed segment from a shared prompt's state (transformers'
    mixer as `install` wraps it, gymv's Megatron one; not the context-parallel one, whose row is split)."""
    found = mixers(model)
    return bool(found) and all(type(m).__name__ in CONTINUES for m in found)


def install(model) -> bool:
    """Wrap every Mamba-2 mixer of `model` that needs it (once); False when it has no Mamba-2 mixer."""
    found = mixers(model)
    for m in (m for m in found if type(m).__name__ in MIXERS):
        if not getattr(m, "gymv_packed", False):
            m.forward = _one_call(m, m.forward)
            m.gymv_packed = True
    return bool(found)


def path(device: torch.device | str) -> str:
    """Which scan a packed forward on `device` runs: "triton" (mamba_ssm's kernels) or "torch"."""
    return "triton" if mamba_kernels.load(device) is not None else "torch"


def mixer_forward(m, hidden_states: torch.Tensor, seq_idx: torch.Tensor | None,
                  kernels: mamba_kernels.Kernels | None = None,
                  prefixes: mamba_prefix.PrefixPlan | None = None) -> torch.Tensor:
    """NemotronH's Mamba-2 mixer `m` over hidden_states [B, L, D] with no padding and no cache, each run of
    equal `seq_idx` [B, L] (int32) a sequence of its own; `kernels`: mamba_ssm's (CUDA), None for the torch
    scan; `prefixes` (one row): the segments that continue a shared prompt. Computes what the mixer's own
    forward computes for each sequence alone (a member: its prompt, then itself)."""
    b, L, _ = hidden_states.shape
    dtype = hidden_states.dtype
    proj = m.in_proj(hidden_states)
    gate, xbc, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    weight = m.conv1d.weight.squeeze(1)
    xbc = segment_conv(kernels, xbc, weight, m.conv1d.bias, seq_idx, m.activation, prefixes)
    groups_state = m.n_groups * m.ssm_state_size
    x, B, C = xbc.split([m.intermediate_size, groups_state, groups_state], dim=-1)
    y = segment_scan(kernels, x.reshape(b, L, m.num_heads, m.head_dim), dt, -torch.exp(m.A_log.float()),
                     B.reshape(b, L, m.n_groups, m.ssm_state_size), C.reshape(b, L, m.n_groups, m.ssm_state_size),
                     m.chunk_size, m.D, m.dt_bias, tuple(m.time_step_limit), seq_idx, prefixes)
    y = y.reshape(b, L, m.intermediate_size)
    if kernels is not None and kernels.gated_norm is not None:
        # silu(gate) times y, RMS-normalised per group and scaled, in one pass each way (the torch norm makes
        # about ten float32 passes over [L, intermediate] in each direction)
        y = kernels.gated_norm(y, m.norm.weight, None, z=gate, eps=m.norm.variance_epsilon,
                               group_size=m.norm.group_size, norm_before_gate=False)
    else:
        y = m.norm(y, gate)
    return m.out_proj(y.to(dtype))


def segment_conv(kernels: mamba_kernels.Kernels | None, xbc: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, seq_idx: torch.Tensor | None, activation: str | None,
                 prefixes: mamba_prefix.PrefixPlan | None = None) -> torch.Tensor:
    """A mixer's causal convolution over a packed row (mamba_kernels.causal_conv), each member of a shared
    prompt continuing the prompt's window (`prefixes`: its taps added before the activation)."""
    if prefixes is None:
        return mamba_kernels.causal_conv(kernels, xbc, weight, bias, seq_idx, activation)
    conv = mamba_kernels.causal_conv(kernels, xbc, weight, bias, seq_idx, None)
    return _activate(mamba_prefix.carry_conv(conv, xbc, weight, prefixes), activation)


def segment_scan(kernels: mamba_kernels.Kernels | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, chunk_size: int, D: torch.Tensor, dt_bias: torch.Tensor,
                 dt_limit: tuple[float, float], seq_idx: torch.Tensor | None,
                 prefixes: mamba_prefix.PrefixPlan | None = None) -> torch.Tensor:
    """The chunked SSD scan y [B, L, H, P] over a packed row (mamba_ssm's kernel, else gymv's torch scan), each
    member of a shared prompt continuing the prompt's state (`prefixes`)."""
    scan = kernels.chunk_scan if kernels is not None else chunk_scan
    y = scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, seq_idx=seq_idx)
    if prefixes is not None:
        y = mamba_prefix.carry_state(y, x, dt, A, B, C, prefixes, dt_bias=dt_bias, dt_limit=dt_limit)
    return y


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(x)
    if activation is not None:
        raise ValueError(f"Mamba-2 mixer activation {activation!r}: gymv's packed mixer runs silu or none")
    return x


def prompt_plan(packing, kernel: int, device) -> mamba_prefix.PrefixPlan:
    """The prompt plan of a packed row with shared prompts (`packing`: its PackedAttentionArgs, whose `keys`
    are set), built once per packed forward: its layers and their recomputation share the args."""
    if packing.prefix_of is None:
        raise RuntimeError("a packed row with shared prompts reached a Mamba-2 layer without saying which "
                           "segment continues which prompt (PackedAttentionArgs.prefix_of)")
    key = (kernel, str(device))
    if key not in packing.plans:
        bounds = packing.bounds[0] if packing.bounds is not None else packing.cu_q.tolist()
        packing.plans[key] = mamba_prefix.plan(bounds, packing.prefix_of, kernel, device)
    return packing.plans[key]


def _one_call(mixer, forward):
    def packed_forward(hidden_states, *args, **kwargs):
        packing = kwargs.pop(KEYWORD, None)
        if packing is None or hidden_states.shape[0] != 1 or args or kwargs.get("cache") is not None:
            return forward(hidden_states, *args, **kwargs)
        prefixes = None
        if packing.keys is not None:
            prefixes = prompt_plan(packing, mixer.conv1d.kernel_size[0], hidden_states.device)
        # the host copy of the bounds where the batch has one (no device read per layer), else the device's
        bounds = packing.bounds[0] if packing.bounds is not None else packing.cu_q
        seq_idx = seq_idx_from_bounds(bounds, hidden_states.shape[1], hidden_states.device)
        return mixer_forward(mixer, hidden_states, seq_idx, mamba_kernels.load(hidden_states.device), prefixes)
    return packed_forward
