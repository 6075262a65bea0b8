"""The routed experts' Triton passes (gymv.backends.moe_kernels) against the torch passes they replace, forward
and every gradient, run by triton's CPU interpreter.

Triton picks its interpreter when it is first imported, so the kernels run in a child process started with
TRITON_INTERPRET=1 (one for the whole module). Shapes are not whole tiles (rows, columns and tokens each end
mid-tile, the backward's row loop runs several column blocks); one input is a column slice of a wider tensor.
The whole experts function runs once with the kernels and once without, as it does on a GPU.
"""

from __future__ import annotations

import textwrap

import pytest

from triton_interpreter import assert_within, run_interpreted

pytest.importorskip("triton")

CHILD = textwrap.dedent("""
    import json, torch
    import torch.nn.functional as F
    from gymv.backends import moe_experts, moe_kernels

    def rel(a, e):
        if a.dtype != e.dtype or a.shape != e.shape:
            return None
        return ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1)).item()

    def relu2(dtype, P=37, I=300, wide=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)
        a = torch.randn(P, I + 16 if wide else I, generator=g).to(dt)
        if wide:  # the rows of a column slice: a row stride wider than the row
            a = a[:, 5:5 + I]
        w = torch.rand(P, generator=g).to(dt)
        r = torch.randn(P, I, generator=g)
        def run(fn):
            x, v = a.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(x, v)
            (out.float() * r).sum().backward()
            return [out, x.grad, v.grad]
        got = run(moe_kernels.scaled_relu2)
        want = run(moe_experts._ScaledRelu2.apply)
        return {n: rel(x, y) for n, x, y in zip(["out", "da", "dw"], got, want)}

    def sums(dtype, T=19, k=3, D=300, seed=0):
        g = torch.Generator().manual_seed(seed)
        rows = torch.randn(T * k, D, generator=g).to(getattr(torch, dtype))
        inverse = torch.randperm(T * k, generator=g)
        return rel(moe_kernels.sum_pairs(rows, inverse, k), F.embedding_bag(inverse.view(-1, k), rows, mode="sum"))

    out = {}
    for dtype in ("float32", "bfloat16"):
        out[f"{dtype}/relu2"] = relu2(dtype)
        out[f"{dtype}/relu2_wide"] = relu2(dtype, wide=True, seed=1)
        out[f"{dtype}/sum_pairs"] = {"out": sums(dtype)}
    out["float32/sum_pairs_k1"] = {"out": sums("float32", k=1, seed=2)}
    out["float32/relu2_one_row"] = relu2("float32", P=1, I=7, seed=3)

    # the experts of a layer (more pairs than SMALL_PAIRS, so the scaled relu² and the pair sum run), with the
    # kernels and without, every gradient; the loop runs the products on a CPU either way
    torch.manual_seed(0)
    T, k, E, D, I = 700, 4, 8, 24, 40
    hidden = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    up, down = torch.randn(E, I, D) * 0.2, torch.randn(E, D, I) * 0.2
    act = type("ReLUSquaredActivation", (), {"__call__": lambda self, x: torch.relu(x) ** 2})()
    def experts(on):
        moe_experts.kernels_on = lambda t: on
        leaves = [t.clone().requires_grad_() for t in (hidden, weights, up, down)]
        y = moe_experts.experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], act, grouped=False)
        y.square().sum().backward()
        return [y] + [t.grad for t in leaves]
    got, want = experts(True), experts(False)
    out["float32/experts"] = {n: rel(x, y) for n, x, y in zip(["out", "dhidden", "dweights", "dup", "ddown"], got, want)}
    with torch.no_grad():  # the one-time check a CUDA device runs first
        out["check"] = moe_experts._check(torch.device("cpu"))
    out["empty"] = [list(moe_kernels.sum_pairs(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), 2).shape),
                    list(moe_kernels.scaled_relu2(torch.zeros(0, 8), torch.zeros(0)).shape)]
    try:
        moe_kernels.scaled_relu2(torch.zeros(4, 8), torch.zeros(3))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    print(json.dumps(out))
""")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(CHILD)


def _check(interpreted, case):
    assert_within(interpreted[case], TOLERANCE[case.split("/")[0]], case)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_scaled_relu2_matches_the_torch_passes_forward_and_both_gradients(interpreted, dtype):
    _check(interpreted, f"{dtype}/relu2")
    assert set(interpreted[f"{dtype}/relu2"]) == {"out", "da", "dw"}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_scaled_relu2_takes_the_rows_of_a_column_slice(interpreted, dtype):
    _check(interpreted, f"{dtype}/relu2_wide")


def test_scaled_relu2_of_one_short_row(interpreted):
    _check(interpreted, "float32/relu2_one_row")


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_the_pair_sum_matches_embedding_bag(interpreted, dtype):
    _check(interpreted, f"{dtype}/sum_pairs")


def test_the_pair_sum_with_one_pair_a_token_is_a_gather(interpreted):
    _check(interpreted, "float32/sum_pairs_k1")


def test_the_experts_with_the_kernels_equal_the_experts_without_them(interpreted):
    _check(interpreted, "float32/experts")
    assert set(interpreted["float32/experts"]) == {"out", "dhidden", "dweights", "dup", "ddown"}


def test_empty_inputs_give_empty_outputs_and_a_mismatched_weight_is_refused(interpreted):
    assert interpreted["empty"] == [[0, 8], [0, 8]]
    assert "w [P]" in interpreted["refused"]


def test_the_one_time_check_passes_the_kernels(interpreted):
    assert interpreted["check"] is True
