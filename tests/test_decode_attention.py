"""The split-sequence decode-attention kernel against PyTorch's SDPA, run by triton's CPU interpreter.

Triton picks its interpreter when it is first imported, so the kernel runs in a child process started with
TRITON_INTERPRET=1 (one for the whole module); on a GPU bench/decode_attention.py times and checks the
compiled kernel.
"""

from __future__ import annotations

import textwrap

import pytest

from triton_interpreter import run_interpreted

pytest.importorskip("triton")

CHILD = textwrap.dedent("""
    import json, torch
    from gymv.backends.generation.decode_attention import available, sdpa, split_attention

    def inputs(B, H, G, D, S, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((B, H, G, D), (B, H, S, D), (B, H, S, D)))
        valid = torch.rand(B, S, generator=g) > 0.3
        valid[:, 0] = True
        return q, k, v, valid

    out = {"errors": {}}
    for dtype in ("float32", "float16", "bfloat16"):
        for pieces in (1, 3, None):
            q, k, v, valid = inputs(3, 2, 2, 32, 200, getattr(torch, dtype))
            got = split_attention(q, k, v, valid, 160, 32 ** -0.5, pieces=pieces)
            want = sdpa(q.float(), k.float(), v.float(), valid, 160, 32 ** -0.5)
            ok = got.dtype == q.dtype and got.shape == q.shape
            out["errors"][f"{dtype}/{pieces}"] = (got.float() - want).abs().max().item() if ok else None
    q, k, v, valid = inputs(2, 1, 3, 16, 100, torch.float32, seed=1)
    valid[:, 40:] = False
    valid[:, 70] = True
    out["empty_pieces"] = (split_attention(q, k, v, valid, 75, 0.3, pieces=3) - sdpa(q, k, v, valid, 75, 0.3)
                           ).abs().max().item()
    cpu = torch.device("cpu")
    out["available"] = [available(cpu, 64), available(cpu, 48)]
    print(json.dumps(out))
""")
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(CHILD)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_split_kernel_matches_sdpa_over_a_masked_window_of_a_longer_cache_in_any_number_of_pieces(interpreted, dtype):
    errs = {k: v for k, v in interpreted["errors"].items() if k.startswith(dtype)}
    assert len(errs) == 3 and all(e is not None and e < TOLERANCE[dtype] for e in errs.values()), errs


def test_a_window_not_a_multiple_of_the_block_and_pieces_with_no_valid_column(interpreted):
    assert interpreted["empty_pieces"] < 1e-5


def test_the_split_kernel_is_only_picked_where_it_can_run(interpreted):
    import torch

    from gymv.backends.generation.decode_attention import available

    assert interpreted["available"] == [True, False]  # the interpreter; a head dim not a power of two
    assert not available(torch.device("cpu"), 64)  # no interpreter, no CUDA


def test_pieces_grow_as_the_batch_shrinks_and_never_go_below_one_block():
    from gymv.backends.generation.decode_attention import BLOCK_N, splits_for

    assert splits_for(1, 8, 448) == 448 // BLOCK_N
    assert splits_for(64, 8, 448) == 1
    assert splits_for(4, 8, 448) > splits_for(16, 8, 448) >= 1
