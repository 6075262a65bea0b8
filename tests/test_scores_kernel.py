"""The vocabulary scores' Triton kernels (gymv.backends.scores_kernel) against gymv.backends.chunked_scores'
torch chunks, forward and backward, run by triton's CPU interpreter.

Triton picks its interpreter when it is first imported, so the kernels run in a child process started with
TRITON_INTERPRET=1 (one for the whole module). The vocabulary is not a whole number of blocks, some ids are
forbidden (a target among them), the temperature is not 1, and one batch of logits is a column slice of a
wider tensor; `chunked_scores` itself runs once with the kernel and once without, through autograd.
"""

from __future__ import annotations

import textwrap

import pytest

from triton_interpreter import assert_within, run_interpreted

pytest.importorskip("triton")

CHILD = textwrap.dedent("""
    import json, torch
    from gymv.backends import chunked_scores, scores_kernel

    def rel(a, e):
        if a is None or e is None or a.dtype != e.dtype or a.shape != e.shape:
            return None
        return ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1)).item()

    def case(dtype, n=9, vocab=5000, temperature=0.7, forbid=True, entropy=True, wide=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        logits = (3 * torch.randn(n, vocab + 24 if wide else vocab, generator=g)).to(getattr(torch, dtype))
        if wide:  # the rows of a column slice: a row stride wider than the vocabulary
            logits = logits[:, 7:7 + vocab]
        target = torch.randint(0, vocab, (n,), generator=g)
        forbidden = None
        if forbid:
            forbidden = torch.zeros(vocab, dtype=torch.bool)
            forbidden[100:140] = True
            target[0] = 120  # a forbidden target
        g_lp = torch.randn(n, generator=g)
        g_ent = torch.randn(n, generator=g) if entropy else None
        lp, ent, lse = scores_kernel.forward(logits, target, forbidden, temperature, entropy)
        wlp, went, wlse = chunked_scores._torch_forward(logits, target, forbidden, temperature, entropy)
        keep = ~forbidden[target] if forbid else torch.ones(n, dtype=torch.bool)
        grad = scores_kernel.backward(logits, target, forbidden, temperature, lse, g_lp, g_ent,
                                      lse - ent if entropy else None)
        want = chunked_scores._torch_backward(logits, target, forbidden, temperature, wlse, g_lp, g_ent)
        out = {"lp": rel(lp[keep], wlp[keep]), "lse": rel(lse, wlse), "grad": rel(grad, want)}
        if entropy:
            out["entropy"] = rel(ent, went)
        return out

    out = {}
    for dtype in ("float32", "bfloat16"):
        out[f"{dtype}/all"] = case(dtype)
        out[f"{dtype}/plain"] = case(dtype, temperature=1.0, forbid=False, entropy=False, seed=1)
    out["float32/wide"] = case("float32", wide=True, seed=2)
    out["float32/short_vocab"] = case("float32", vocab=300, seed=3)

    # chunked_scores through autograd, with the kernel and without: logprobs, entropies and the gradient
    g = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(11, 3000, generator=g))
    target = torch.randint(0, 3000, (11,), generator=g)
    forbidden = torch.zeros(3000, dtype=torch.bool)
    forbidden[5:9] = True
    w = torch.randn(11, generator=g)
    def scored(on):
        chunked_scores.kernel_on = lambda t: on
        x = logits.clone().requires_grad_()
        lp, ent, lse = chunked_scores.chunked_scores(x, target, forbidden, 0.9, True)
        ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
        return [lp, ent, lse, x.grad]
    got, want = scored(True), scored(False)
    out["float32/autograd"] = {n: rel(a, b) for n, a, b in zip(["lp", "entropy", "lse", "grad"], got, want)}
    with torch.no_grad():  # the one-time check a CUDA device runs first
        out["check"] = chunked_scores._check(torch.device("cpu"))
    print(json.dumps(out))
""")
# float32 math either way; a bfloat16 gradient is stored in bfloat16 (an exponential an ulp apart flips its rounding)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-5, "bfloat16 grad": 1e-2}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(CHILD)


def _check(interpreted, case, names):
    errs = interpreted[case]
    assert set(errs) == names, errs
    dtype = case.split("/")[0]
    for name, e in errs.items():
        assert_within({name: e}, TOLERANCE.get(f"{dtype} {name}", TOLERANCE[dtype]), case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forbidden_ids_and_a_temperature_match_the_torch_chunks_entropy_included(interpreted, dtype):
    _check(interpreted, f"{dtype}/all", {"lp", "lse", "grad", "entropy"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_logprobs_without_entropy_match(interpreted, dtype):
    _check(interpreted, f"{dtype}/plain", {"lp", "lse", "grad"})


def test_the_rows_of_a_column_slice_match(interpreted):
    _check(interpreted, "float32/wide", {"lp", "lse", "grad", "entropy"})


def test_a_vocabulary_shorter_than_one_block_matches(interpreted):
    _check(interpreted, "float32/short_vocab", {"lp", "lse", "grad", "entropy"})


def test_chunked_scores_with_the_kernel_equal_it_without_through_autograd(interpreted):
    _check(interpreted, "float32/autograd", {"lp", "entropy", "lse", "grad"})


def test_the_one_time_check_passes_the_kernel(interpreted):
    assert interpreted["check"] is True
