"""Mamba-2 over a packed row whose sequences continue a shared prompt, exactly, from one zero-state call.

A GRPO group's G samples share their prompt (and its pictures); a packed row can hold that prompt once, with
each member's rest as a segment of its own (gymv.backends.packing). Attention reads the prompt's keys; a
Mamba-2 mixer must instead start each member from the prompt's final convolution window and SSM state, which
the chunked scan kernels (one call per row, a zero state at each `seq_idx` change) cannot take per segment.
Both recurrences are linear in what came before, so the row runs as it is, every segment from zero, and the
prompt's part is added afterwards:

- convolution: a member's first K-1 outputs miss the taps that would read the prompt's last K-1 inputs; those
  products are added before the activation (`carry_conv`).
- SSM: the state after the prompt is H = sum over its tokens u of exp(sum of dt*A after u) * dt_u * B_u x_u^T;
  token t of a member then gains C_t . (exp(sum of dt*A over the member up to t) * H) (`carry_state`).

The sums of dt*A run in float64 (a row's total decay is tens of thousands; their differences stay exact), the
rest in float32, as the scan computes. `plan` lays out, on the host and once per packed row, which tokens
belong to which prompt; a member's gradient reaches its prompt through the same products.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gymv.backends.host_copy import to_device_many


@dataclass
class PrefixPlan:
    """Index tensors of one packed row with shared prompts (P prompts, each padded to the longest prompt, Lp,
    and its members' tokens, together, to the most any prompt has, M); padding points at token 0 and is
    zeroed by the `keep` masks."""

    prompt_pos: torch.Tensor  # [P, Lp] row positions of each prompt's tokens
    prompt_keep: torch.Tensor  # [P, Lp] 1.0 on real tokens
    prompt_last: torch.Tensor  # [P] row position of each prompt's last token
    member_pos: torch.Tensor  # [P, M] row positions of the tokens of each prompt's members
    member_first: torch.Tensor  # [P, M] row position of the first token of the token's own segment
    member_keep: torch.Tensor  # [P, M]
    member_sel: torch.Tensor  # [Tm] index into the flattened [P * M] of each real member token
    member_rows: torch.Tensor  # [Tm] its row position
    conv_target: torch.Tensor  # [Q] a member token among its segment's first K - 1
    conv_source: torch.Tensor  # [Q] the prompt token one of its missing taps reads
    conv_tap: torch.Tensor  # [Q] which tap


def plan(bounds: Sequence[int], prefix_of: Sequence[int], kernel: int, device=None) -> PrefixPlan | None:
    """The plan of a row whose segments start at `bounds[:-1]` (cumulative, host ints); `prefix_of[s]`: the
    segment holding segment s's shared prompt, or -1. None when no segment continues a prompt. `kernel`: the
    convolution's width K."""
    members: dict[int, list[int]] = {}
    for s, q in enumerate(prefix_of):
        if q >= 0:
            members.setdefault(q, []).append(s)
    if not members:
        return None
    prompts = sorted(members)
    lp = max(bounds[q + 1] - bounds[q] for q in prompts)
    sizes = [sum(bounds[s + 1] - bounds[s] for s in members[q]) for q in prompts]
    m = max(sizes)
    P = len(prompts)
    prompt_pos = np.zeros((P, lp), dtype=np.int64)
    prompt_keep = np.zeros((P, lp), dtype=np.float32)
    member_pos = np.zeros((P, m), dtype=np.int64)
    member_first = np.zeros((P, m), dtype=np.int64)
    member_keep = np.zeros((P, m), dtype=np.float32)
    sel, rows, target, source, tap = [], [], [], [], []
    for i, q in enumerate(prompts):
        start, end = bounds[q], bounds[q + 1]
        prompt_pos[i, :end - start] = np.arange(start, end)
        prompt_keep[i, :end - start] = 1.0
        at = 0
        for s in members[q]:
            a, b = bounds[s], bounds[s + 1]
            n = b - a
            member_pos[i, at:at + n] = np.arange(a, b)
            member_first[i, at:at + n] = a
            member_keep[i, at:at + n] = 1.0
            sel.append(np.arange(i * m + at, i * m + at + n))
            rows.append(np.arange(a, b))
            at += n
            for k in range(min(kernel - 1, n)):  # token a + k reads the prompt through taps j < K - 1 - k
                for j in range(kernel - 1 - k):
                    src = end + k - (kernel - 1) + j
                    if src >= start:
                        target.append(a + k)
                        source.append(src)
                        tap.append(j)
    as_long = lambda v: torch.from_numpy(np.asarray(v, dtype=np.int64))  # noqa: E731
    tensors = [torch.from_numpy(prompt_pos), torch.from_numpy(prompt_keep),
               as_long([bounds[q + 1] - 1 for q in prompts]), torch.from_numpy(member_pos),
               torch.from_numpy(member_first), torch.from_numpy(member_keep), as_long(np.concatenate(sel)),
               as_long(np.concatenate(rows)), as_long(target), as_long(source), as_long(tap)]
    if device is not None:
        tensors = to_device_many(tensors, device)
    return PrefixPlan(*tensors)


def carry_conv(out: torch.Tensor, xbc: torch.Tensor, weight: torch.Tensor, p: PrefixPlan) -> torch.Tensor:
    """`out` [1, L, C], the convolution of `xbc` [1, L, C] (weight [C, K]) with every segment from zero and
    no activation, with each member's taps into its prompt added."""
    if p.conv_target.numel() == 0:
        return out
    src = xbc[0].index_select(0, p.conv_source).float()
    taps = weight.t().index_select(0, p.conv_tap).float()
    return out.index_add(1, p.conv_target, (src * taps).to(out.dtype)[None])


def carry_state(y: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, p: PrefixPlan, dt_bias: torch.Tensor | None = None,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """`y` [1, L, H, P], the scan of x [1, L, H, P] (dt [1, L, H] before its bias and softplus, A [H], B/C
    [1, L, G, N]) with every segment from a zero state, plus each member's part of its prompt's final state."""
    heads, dim = x.shape[2], x.shape[3]
    groups, n = B.shape[2], B.shape[3]
    per = heads // groups
    dt = dt[0].float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    dt = F.softplus(dt).clamp(min=dt_limit[0], max=dt_limit[1])  # [L, H]
    # [H, L + 1]: cum[:, t] = the sum before t, along the innermost dimension (a scan along the outer one of
    # [L, H] took about a millisecond a call on an H100)
    cum = F.pad(torch.cumsum((dt * A.float()).t().double().contiguous(), dim=-1), (1, 0))
    # gathers by index_select on flat indices: their backward adds rows back (advanced indexing's sorted
    # the indices first), and only the gathered rows are cast to float32
    pos = p.prompt_pos
    P, lp = pos.shape
    at = pos.reshape(-1)

    def rows(t: torch.Tensor, index: torch.Tensor, *shape: int) -> torch.Tensor:
        return t.index_select(0, index).reshape(*shape).float()

    def sums(index: torch.Tensor, *shape: int) -> torch.Tensor:  # [*shape, H] of `cum` at flat `index`
        return cum.index_select(1, index.reshape(-1)).reshape(heads, *shape)

    # [P, Lp, H]: the decay after token u to the prompt's end
    decay = torch.exp(sums(p.prompt_last + 1, P, 1) - sums(at + 1, P, lp)).float().permute(1, 2, 0)
    weight = decay * rows(dt, at, P, lp, heads) * p.prompt_keep[..., None]
    xw = rows(x[0], at, P, lp, groups, per, dim) * weight.reshape(P, lp, groups, per, 1)
    state = torch.einsum("plgkd,plgn->pgkdn", xw, rows(B[0], at, P, lp, groups, n))
    mpos = p.member_pos
    m = mpos.shape[1]
    grow = torch.exp(sums(mpos + 1, P, m) - sums(p.member_first, P, m)).float().permute(1, 2, 0)
    grow = grow * p.member_keep[..., None]  # [P, M, H]
    out = torch.einsum("pmgn,pgkdn->pmgkd", rows(C[0], mpos.reshape(-1), P, m, groups, n), state)
    out = (out.reshape(P, m, heads, dim) * grow[..., None]).reshape(P * m, heads, dim).index_select(0, p.member_sel)
    return y.index_add(1, p.member_rows, out.to(y.dtype)[None])
