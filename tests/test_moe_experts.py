"""gymv.backends.moe_experts: Nemotron-H's routed experts as grouped matrix products over expert-sorted
(token, expert) pairs, against transformers' own expert loop (real `NemotronHExperts`, tiny widths, float32),
experts that get no token included; the bfloat16 CUDA kernel in the `gpu` tests at the end."""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from gymv.backends import moe_experts

E, D, I, T, K = 6, 32, 16, 20, 2


def transformers_experts(device="cpu", dtype=torch.float32) -> NemotronHExperts:
    cfg = NemotronHConfig(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                          layers_block_type=["moe"], vocab_size=16)
    m = NemotronHExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.up_proj.copy_(torch.randn(m.up_proj.shape, generator=g) / D ** 0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) / I ** 0.5)
    return m.to(device=device, dtype=dtype)


def routing(device="cpu"):
    """Top-2 of experts 0-3 only (4 and 5 get no token; expert 2 gets most), with router-like weights."""
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, 4, (T,), generator=g), torch.full((T,), 2)], dim=1)
    ids[ids[:, 0] == 2, 0] = 0
    return ids.to(device), torch.rand(T, K, generator=g).to(device)


@pytest.fixture(params=["few_pairs", "many_pairs"])
def pairs(request, monkeypatch):
    """Both sizes' paths: a decode step's few pairs (a comparison rank, index_copy and sum) and a training
    pass's many (a sort, the gather-sum kernel), the latter by lowering the bound to 0."""
    if request.param == "many_pairs":
        monkeypatch.setattr(moe_experts, "SMALL_PAIRS", 0)
    return request.param


def _run(fn, m, h, ids, w):
    m.zero_grad()
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(h, ids, w)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return out.detach(), {"hidden": h.grad, "weights": w.grad, "up": m.up_proj.grad.clone(), "down": m.down_proj.grad.clone()}


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_experts_equal_transformers_loop_forward_and_gradients(grouped, pairs):
    m = transformers_experts()
    h, (ids, w) = torch.randn(T, D), routing()
    want, want_grads = _run(m.forward, m, h, ids, w)
    got, grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, m.act_fn, grouped=grouped),
                      m, h, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert grads["up"][4:].abs().sum() == 0 and grads["down"][5].abs().sum() == 0  # unused experts: no gradient


def test_an_activation_that_autocast_runs_in_float32_still_feeds_the_grouped_kernel_its_dtype():
    """CUDA's autocast runs relu²'s square (a pow) in float32; the down projection's kernel takes one dtype."""
    m = transformers_experts()
    h, (ids, w) = torch.randn(T, D), routing()
    relu2_in_float32 = lambda t: torch.relu(t).float().square()  # noqa: E731 - what the CUDA autocast hands back
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, relu2_in_float32),
                          m, h, ids, w)
    want, _ = _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, m.act_fn), m, h, ids, w)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    assert all(g is not None for g in grads.values())


def test_the_backward_scatters_nothing_with_atomics_and_keeps_the_weights_in_the_experts_dtype(pairs):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, torch.dtype | None, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((str(func.overloadpacket), getattr(out, "dtype", None), tuple(getattr(out, "shape", ()))))
            return out

    m = transformers_experts(dtype=torch.bfloat16)
    h, (ids, w) = torch.randn(T, D, dtype=torch.bfloat16), routing()
    with Ops() as ops:
        _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, m.act_fn, grouped=False), m, h, ids, w)
    names = [n for n, _, _ in ops.seen]
    assert not any("index_add" in n or "index_put" in n or n.endswith("scatter_add") for n in names), names
    # the float32 router weights meet the pairs in bfloat16: no tensor of the pairs' rows is ever float32
    pair_rows = [(n, shape) for n, dtype, shape in ops.seen if dtype == torch.float32 and len(shape) == 2
                 and shape[0] == T * K and shape[1] > 1]
    assert not pair_rows, pair_rows


def test_the_permutation_sorts_pairs_by_expert_and_ends_each_experts_run():
    ids = torch.tensor([[3, 0], [0, 1], [3, 3]])
    order, offsets = moe_experts.permutation(ids, 5)
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert offsets.tolist() == [2, 3, 3, 6, 6] and offsets.dtype == torch.int32


def test_small_and_large_permutations_agree_with_a_stable_sort(monkeypatch):
    g = torch.Generator().manual_seed(0)
    for tokens, k, experts in ((64, 6, 128), (7, 2, 3), (1, 1, 4), (300, 6, 128)):
        ids = torch.randint(0, experts, (tokens, k), generator=g)
        want_ids, want_order = torch.sort(ids.reshape(-1), stable=True)
        for small in (0, moe_experts.SMALL_PAIRS):  # 0: every size takes the sort
            monkeypatch.setattr(moe_experts, "SMALL_PAIRS", small)
            order, offsets, inverse = moe_experts._permutation(ids, experts)
            assert order.tolist() == want_order.tolist()
            assert offsets.tolist() == [int((want_ids < e + 1).sum()) for e in range(experts)]
            assert order[inverse].tolist() == list(range(tokens * k))


def test_on_cpu_grouped_mm_is_used_for_aligned_float32_widths_only():
    m = transformers_experts()
    assert moe_experts.grouped_available(torch.randn(T, D), m.up_proj, m.down_proj)
    odd = torch.randn(E, 6, 10)
    assert not moe_experts.grouped_available(torch.randn(T, 10), odd, odd.transpose(1, 2).contiguous())


def test_under_a_bfloat16_autocast_float32_weights_go_to_the_grouped_kernel_as_autocast_casts_them(pairs):
    m = transformers_experts()
    h, (ids, w) = torch.randn(T, D), routing()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        up, down = moe_experts.autocast_weights(h, m.up_proj, m.down_proj)
        assert up.dtype == down.dtype == torch.bfloat16
        assert moe_experts.grouped_available(h.bfloat16(), up, down)
        got, grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, m.act_fn), m, h, ids, w)
        want, want_grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m.up_proj, m.down_proj, m.act_fn,
                                                                   grouped=False), m, h, ids, w)
    assert got.dtype == torch.float32  # the caller's dtype, as before
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # both bfloat16 products, another kernel
    for name in want_grads:  # the float32 master weights get their gradients through the cast
        assert grads[name] is not None
        torch.testing.assert_close(grads[name], want_grads[name], atol=5e-2, rtol=5e-2)
    assert moe_experts.autocast_weights(h, m.up_proj, m.down_proj)[0] is m.up_proj  # no autocast: as they are


def test_a_loaded_policy_runs_its_experts_here_and_scores_as_transformers_loop():
    from tiny_models import fresh_policy

    policy = fresh_policy("tiny-nemotron-omni")
    found = [m for m in policy.model.modules() if type(m).__name__ == "NemotronHExperts"]
    assert found and all(getattr(m, "gymv_experts", False) for m in found)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        got = policy.model(input_ids=ids).logits
        assert moe_experts.uninstall(policy.model) == len(found)  # back to transformers' own forward,
        for m in found:  # on its expert loop
            m.config._experts_implementation = "eager"
        want = policy.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- the grouped kernel on CUDA (bfloat16) --------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bfloat16_grouped_experts_match_the_float32_loop(pairs):
    m32 = transformers_experts("cuda")
    m16 = transformers_experts("cuda", torch.bfloat16)
    h, (ids, w) = torch.randn(T, D, device="cuda"), routing("cuda")
    assert moe_experts.grouped_available(h.bfloat16(), m16.up_proj, m16.down_proj)
    want, want_grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m32.up_proj, m32.down_proj, m32.act_fn,
                                                               grouped=False), m32, h, ids, w)
    got, grads = _run(lambda a, b, c: moe_experts.experts(a, b, c, m16.up_proj, m16.down_proj, m16.act_fn),
                      m16, h.bfloat16(), ids, w)
    def rel(a, b):  # bfloat16 against float32: the norm of the difference against the norm
        return float((a.float() - b).norm() / b.norm())
    assert rel(got, want) < 2e-2
    for name in want_grads:
        assert rel(grads[name], want_grads[name]) < 3e-2, name


@pytest.mark.gpu
def test_gpu_float32_master_weights_under_autocast_run_the_grouped_kernel_without_a_sync():
    """The torch and megatron backends on CUDA keep float32 weights under a bfloat16 autocast: the experts must
    not fall back to the loop, whose per-expert slices read the offsets back every layer."""
    m = transformers_experts("cuda")
    h, (ids, w) = torch.randn(T, D, device="cuda", requires_grad=True), routing("cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe_experts.experts(h, ids, w, m.up_proj, m.down_proj, m.act_fn)
        out.float().pow(2).sum().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert m.up_proj.grad is not None and m.up_proj.grad.dtype == torch.float32


@pytest.mark.gpu
def test_gpu_grouped_experts_forward_and_backward_read_nothing_back_from_the_device(pairs):
    m = transformers_experts("cuda", torch.bfloat16)
    h, (ids, w) = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True), routing("cuda")
    moe_experts.experts(h, ids, w, m.up_proj, m.down_proj, m.act_fn).float().pow(2).sum().backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts.experts(h, ids, w, m.up_proj, m.down_proj, m.act_fn).float().pow(2).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_scaled_relu2_passes_gradcheck_and_keeps_only_its_inputs():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(12, 5, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.rand(12, dtype=torch.float64, generator=g).requires_grad_()
    assert torch.autograd.gradcheck(moe_experts._ScaledRelu2.apply, (a, w))
    out = moe_experts._ScaledRelu2.apply(a, w)
    torch.testing.assert_close(out, torch.relu(a).square() * w.unsqueeze(-1))
    assert [t.data_ptr() for t in out.grad_fn.saved_tensors] == [a.data_ptr(), w.data_ptr()]


@pytest.mark.gpu
def test_gpu_the_triton_passes_equal_the_torch_passes_at_the_nanos_widths(monkeypatch):
    """gymv.backends.moe_kernels (relu² and the pair sum) on CUDA, bf16, 2,048 tokens of the Nano's experts
    (128 of width 1,856, top 6, hidden 2,688), against the same experts with GYMV_MOE_KERNELS=0."""
    from gymv.backends import moe_kernels

    if not moe_kernels.available():
        pytest.skip("triton does not import")
    g = torch.Generator().manual_seed(3)
    tokens, hidden, width, experts, k = 2048, 2688, 1856, 128, 6
    up = (torch.randn(experts, width, hidden, generator=g) / hidden ** 0.5).to("cuda", torch.bfloat16)
    down = (torch.randn(experts, hidden, width, generator=g) / width ** 0.5).to("cuda", torch.bfloat16)
    h = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, k, generator=g).cuda()
    act = NemotronHExperts(NemotronHConfig(hidden_size=8, moe_intermediate_size=8, n_routed_experts=2,
                                           num_experts_per_tok=1, layers_block_type=["moe"], vocab_size=16)).act_fn

    def run(switch):
        monkeypatch.setenv(moe_experts.SWITCH, switch)
        leaves = [t.clone().requires_grad_() for t in (h, w, up, down)]
        out = moe_experts.experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], act)
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
        return [out] + [t.grad for t in leaves]

    got, want = run("1"), run("0")
    for name, a, b in zip(["out", "hidden", "weights", "up", "down"], got, want):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2, name
