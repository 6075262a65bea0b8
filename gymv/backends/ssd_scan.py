"""Mamba-2's chunked SSD scan and causal depthwise convolution in torch, with sequence resets.

A packed row holds several sequences back to back; a Mamba-2 mixer over it must start every sequence from a
zero state (no convolution window and no SSM state crosses a sequence's start). transformers' torch path
takes no segment boundaries (its `seq_idx` reaches only `mamba_ssm`'s CUDA kernels), so gymv carries its
own torch scan that does: one call over the whole packed row, the reference every kernel path is compared
with, and the path on CPU. It is shared by every backend that runs a Mamba-2 mixer over packed rows (the
HF trainer's gymv.backends.packed_mamba, a Megatron Mamba mixer): the public functions below are its whole
interface.

- `seq_idx_from_bounds(bounds, length, device)`: the [1, L] int32 sequence index of a packed row from its
  cumulative segment starts (the form `mamba_ssm.mamba_chunk_scan_combined(seq_idx=...)` takes too).
- `segment_conv1d(x, weight, bias, seq_idx, activation)`: causal depthwise convolution over [B, L, C] whose
  windows never reach into an earlier sequence (as if each sequence were zero-padded on its left).
- `chunk_scan(x, dt, A, B, C, chunk_size, D=, dt_bias=, dt_softplus=, dt_limit=, seq_idx=, initial_states=,
  return_final_states=)`: the SSD scan with the argument names and shapes of `mamba_chunk_scan_combined`
  (x [B, L, H, P], dt [B, L, H], A [H], B/C [B, L, G, N], seq_idx [B, L]); computed in float32 as
  transformers' torch path computes it (state-space duality: a masked quadratic form inside each chunk,
  a recurrence over the chunks' states between them), with every term that would cross a sequence start
  masked to zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def seq_idx_from_bounds(bounds: Sequence[int] | torch.Tensor, length: int, device=None) -> torch.Tensor:
    """The sequence index [1, length] (int32) of a packed row whose segments start at `bounds[:-1]`
    (cumulative starts, `bounds[0] == 0`); tokens after the last bound (padding) belong to the last segment."""
    b = torch.as_tensor(bounds, dtype=torch.long, device=device)
    pos = torch.arange(length, device=b.device)
    return (torch.searchsorted(b[1:-1].contiguous(), pos, right=True)).to(torch.int32).unsqueeze(0)


def segment_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   seq_idx: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """Causal depthwise convolution of x [B, L, C] with weight [C, K] (a `Conv1d(groups=C)` weight squeezed):
    out[t] = bias + sum_k weight[:, k] * x[t - K + 1 + k], where a term whose input lies in another sequence
    than t's (per `seq_idx` [B, L]) or before the row is zero. `activation`: None, "silu" or "swish"."""
    Bsz, L, Ch = x.shape
    K = weight.shape[-1]
    w = weight.to(x.dtype)
    xt = F.pad(x, (0, 0, K - 1, 0))  # [B, L + K - 1, C]
    sq = F.pad(seq_idx, (K - 1, 0), value=-1) if seq_idx is not None else None
    out = None
    for k in range(K):
        term = xt[:, k:k + L] * w[:, k]
        if sq is not None and k < K - 1:  # the last tap is t itself, always in t's sequence
            term = term * (sq[:, k:k + L] == seq_idx).unsqueeze(-1).to(x.dtype)
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.to(x.dtype)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"segment_conv1d: activation {activation!r} (silu or None)")
    return out


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = sum(a[j+1 .. i]) for j <= i, -inf above the diagonal; summed
    along the masked copies (not as differences of a cumulative sum), which stays exact for long chunks."""
    T = a.size(-1)
    a = a[..., None].expand(*a.shape, T)
    low = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(a.masked_fill(~low, 0), dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device)), -torch.inf)


def _chunks(t: torch.Tensor, pad: int, size: int) -> torch.Tensor:
    """[B, L, ...] -> [B, L / size, size, ...], zero-padded at the end."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, size, *t.shape[2:])


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
               seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
               return_final_states: bool = False):
    """The Mamba-2 SSD scan y [B, L, H, P] (float32) of x [B, L, H, P]; with `seq_idx` [B, L] the state
    restarts (from zero) at each change of index, so one call over a packed row equals one call per
    sequence. `initial_states` [B, H, P, N] is the state before the row's first sequence;
    `return_final_states` also returns the state after the last token [B, H, P, N] (of the last sequence)."""
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=2)
    C = C.float().repeat_interleave(heads // groups, dim=2)
    pad = (chunk_size - length % chunk_size) % chunk_size
    skip = D.float()[:, None] * x if D is not None else None
    xd = x * dt[..., None]
    a = A.float() * dt  # [B, L, H] log-decay of each step
    xd, a, B, C = (_chunks(t, pad, chunk_size) for t in (xd, a, B, C))  # [b, c, l, ...]
    a = a.permute(0, 3, 1, 2)  # [b, h, c, l]
    a_cum = torch.cumsum(a, dim=-1)
    nchunks = a.shape[2]
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(f"chunk_scan: seq_idx must be [batch, length] = {(batch, length)}, got "
                             f"{tuple(seq_idx.shape)}")
        sq = seq_idx.long()
        sq = _chunks(torch.cat([sq, sq[:, -1:].expand(-1, pad)], dim=1), 0, chunk_size)  # the tail: the last's
        # the sequence each chunk's start state belongs to: the last token's of the chunk before (the first
        # token's for the first chunk, whose start state is `initial_states`)
        starts = torch.cat([sq[:, :1, 0], sq[:, :, -1]], dim=1)  # [b, c + 1]

    # 1. inside each chunk: a causal, decaying quadratic form (the "attention" side of the duality)
    decay = torch.exp(_segsum(a))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    if seq_idx is not None:
        scores = scores * (sq[:, :, :, None] == sq[:, :, None, :]).unsqueeze(1).to(scores.dtype)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xd)

    # 2. each chunk's own contribution to the state at its end (tokens of the chunk's last sequence only)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, l]
    if seq_idx is not None:
        to_end = to_end * (sq == sq[:, :, -1:]).unsqueeze(1).to(to_end.dtype)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, xd)

    # 3. the state at each chunk's start: the earlier chunks' states, decayed, within one sequence
    first = initial_states.float()[:, None] if initial_states is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([first, states], dim=1)  # [b, c + 1, h, p, n]
    carry = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    if seq_idx is not None:
        carry = carry * (starts[:, :, None] == starts[:, None, :]).unsqueeze(1).to(carry.dtype)
    states = torch.einsum("bhzc,bchpn->bzhpn", carry, states)
    states, final = states[:, :-1], states[:, -1]

    # 4. the start state's part of each token's output (tokens still in the chunk's first sequence only)
    out_decay = torch.exp(a_cum)  # [b, h, c, l]
    if seq_idx is not None:
        out_decay = out_decay * (sq == starts[:, :-1, None]).unsqueeze(1).to(out_decay.dtype)
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, out_decay)
    y = y.reshape(batch, nchunks * chunk_size, heads, head_dim)[:, :length]
    if skip is not None:
        y = y + skip
    return (y, final) if return_final_states else y
