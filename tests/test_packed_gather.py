"""A packed row's shared-prompt keys: gathered once per member, their gradients added back without atomics,
equal to index_select's autograd up to the order of the additions, for the layouts `pack` makes."""

from __future__ import annotations

import random

import pytest
import torch

from gymv.backends import packed_attention
from gymv.backends.packed_gather import KeyGather, gather
from gymv.backends.packing import PackedAttentionArgs, pack

LAYOUTS = {
    "uneven members and groups of one": [(3, 5), (1, 4), (2, 7), (5, 3), (1, 0), (2, 1)],
    "one large group": [(8, 11)],
    "plain rows between groups": [(1, 0), (4, 6), (1, 0), (1, 0), (2, 9)],
}


def _row(groups: list[tuple[int, int]], seed: int = 0):
    """A packed row of groups (members, prompt length); prompt length 0: rows sharing nothing."""
    rng = random.Random(seed)
    prefixes, lengths = [], []
    for g, (members, plen) in enumerate(groups):
        for _ in range(members):
            prefixes.append((g, plen) if plen else None)
            lengths.append(plen + rng.randint(1, 9))
    width = max(lengths)
    ids = torch.randint(3, 50, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return pack(ids, mask, [[] for _ in lengths], prefixes)


def _random_groups(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    groups = [(rng.randint(1, 6), rng.choice([0, rng.randint(1, 12)])) for _ in range(rng.randint(1, 6))]
    return groups + [(rng.randint(2, 6), rng.randint(1, 12))]  # at least one prompt shared


@pytest.mark.parametrize("groups", [*LAYOUTS.values(), *(_random_groups(s) for s in range(6))],
                         ids=[*LAYOUTS, *(f"random {s}" for s in range(6))])
def test_gathered_keys_and_their_gradients_equal_index_select_autograd(groups):
    row = _row(groups)
    g = torch.Generator().manual_seed(1)
    n = row.input_ids.numel()
    k, v = (torch.randn(n, 2, 3, generator=g, requires_grad=True) for _ in range(2))
    k0, v0 = (t.detach().clone().requires_grad_(True) for t in (k, v))
    got = gather(row.keys, k, v)
    want = (k0.index_select(0, row.keys.index), v0.index_select(0, row.keys.index))
    weights = [torch.randn(t.shape, generator=g) for t in want]
    sum((t * w).sum() for t, w in zip(got, weights)).backward()
    sum((t * w).sum() for t, w in zip(want, weights)).backward()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(k.grad, k0.grad) and torch.equal(v.grad, v0.grad)  # on the CPU: copy after copy


def test_a_row_whose_groups_share_no_prompt_has_no_keys_to_gather():
    assert _row([(1, 5), (1, 0), (1, 3)]).keys is None


def test_a_shared_prompts_positions_have_one_copy_per_member_besides_their_own():
    row = _row([(3, 4), (2, 2)])
    p = row.starts[3] - 2  # the second group's prompt lies just before its first member
    assert row.keys.repeated.tolist() == [0, 1, 2, 3, p, p + 1]
    # the first group's prompt: its own segment's copy and one per member (4); the second's: 3
    assert [tuple(t.shape) for t in row.keys.tables] == [(4, 4), (3, 2)]
    assert row.keys.tables[1][0].tolist() == row.keys.first[[p, p + 1]].tolist()


def test_a_key_index_that_leaves_a_row_position_out_is_refused():
    with pytest.raises(ValueError, match="at least once"):
        KeyGather.build(torch.tensor([0, 1, 1, 3]), 4)


def test_per_segment_attention_takes_segment_bounds_from_the_host():
    row = _row(LAYOUTS["uneven members and groups of one"])
    args = row.attention_args("cpu")
    g = torch.Generator().manual_seed(2)
    n = row.input_ids.numel()
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h in (4, 2, 2))
    want = packed_attention._per_segment(q, k, v, PackedAttentionArgs(args.cu_q, args.keys, args.cu_k,
                                                                      args.max_q, args.max_k), None, 0.0)
    on_meta = PackedAttentionArgs(args.cu_q.to("meta"), args.keys, args.cu_k.to("meta"), args.max_q, args.max_k,
                                  args.bounds)  # a device read of these would fail
    assert torch.equal(packed_attention._per_segment(q, k, v, on_meta, None, 0.0), want)


@pytest.mark.gpu
def test_varlen_attention_over_shared_prompts_never_waits_for_the_gpu():
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16  # a tensor's own device
    if packed_attention._varlen_kernel() is None or not all(packed_attention._varlen_checks(device, dtype)):
        pytest.skip("no varlen kernel with a bottom-right causal mask in this torch")
    row = _row(LAYOUTS["uneven members and groups of one"])
    args = row.attention_args(device)
    n = row.input_ids.numel()
    q, k, v = (torch.randn(1, h, n, 64, device=device, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    packed_attention.prepare(device)  # the one-time checks, as a packed forward pass runs them first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = packed_attention._packed(q, k, v, None, args, 0.0, None)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert k.grad is not None and bool(torch.isfinite(k.grad).all())


@pytest.mark.gpu
def test_gathered_key_gradients_on_cuda_equal_index_select_autograd():
    row = _row(_random_groups(3) + [(8, 40)])
    plan = row.keys.to("cuda")
    k = torch.randn(row.input_ids.numel(), 8, 128, device="cuda", dtype=torch.float64, requires_grad=True)
    k0 = k.detach().clone().requires_grad_(True)
    w = torch.randn(plan.index.numel(), 8, 128, device="cuda", dtype=torch.float64)
    (gather(plan, k)[0] * w).sum().backward()
    (k0.index_select(0, plan.index) * w).sum().backward()
    torch.testing.assert_close(k.grad, k0.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_repeated_heads_equal_repeat_interleave_in_value_and_gradient(groups):
    from gymv.backends.packed_attention import repeat_heads

    base = torch.randn(1, 3, 40, 8, dtype=torch.float64, requires_grad=True)
    twin = base.detach().clone().requires_grad_(True)
    weight = torch.randn(40, 3 * groups, 8, dtype=torch.float64)
    ours = repeat_heads(base.squeeze(0).transpose(0, 1), groups)  # a strided view, as packed attention passes it
    theirs = twin.squeeze(0).transpose(0, 1).repeat_interleave(groups, dim=1)
    assert torch.equal(ours, theirs)
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()
    torch.testing.assert_close(base.grad, twin.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_attention_in_the_input_layout_the_kernel_accepted_equals_per_segment_sdpa(layout):
    """Grouped-query keys passed with their own heads and strided views passed without copies, where the
    one-time check accepted them, give per-segment SDPA's outputs and gradients over shared prompts."""
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    if packed_attention._varlen_kernel() is None or not all(packed_attention._varlen_checks(device, dtype)):
        pytest.skip("no varlen kernel with a bottom-right causal mask in this torch")
    gqa, views = packed_attention._varlen_inputs(device, dtype)
    row = _row(LAYOUTS[layout])
    args = row.attention_args(device)
    n = row.input_ids.numel()
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(1, h, n, 64, generator=g).to(device, dtype) for h in (8, 2, 2)]
    weight = torch.randn(1, n, 8, 64, generator=g).to(device)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in base]
        out = fn(*leaves)
        (out.float() * weight).sum().backward()
        return [out.float(), *(t.grad.float() for t in leaves)]

    want = grads(lambda q, k, v: packed_attention._per_segment(q, k, v, args, None, 0.0))
    got = grads(lambda q, k, v: packed_attention._call_varlen(q, k, v, args, None, gqa=gqa, views=views))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
