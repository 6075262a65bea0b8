"""gymv.backends.packed_mamba's one-call mixer over a packed row: transformers' NemotronH Mamba-2 mixer (real
class, tiny widths, float32) run once per sequence is the reference; the torch scan runs here, mamba_ssm's
Triton kernels on a GPU (the `gpu` tests at the end)."""

from __future__ import annotations

import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from gymv.backends import mamba_kernels, mamba_prefix, packed_mamba
from gymv.backends.ssd_scan import seq_idx_from_bounds

BOUNDS = [0, 7, 8, 30, 45]  # a one-token sequence; sequences across the 16-token chunks


def mixer(seed: int = 0, dtype=torch.float32, device="cpu", width: int = 8) -> NemotronHMamba2Mixer:
    """`width`: the head dim and state size (16 on the GPU, where Triton's matrix products take 16 at least)."""
    cfg = NemotronHConfig(hidden_size=32, mamba_num_heads=4, mamba_head_dim=width, ssm_state_size=width, n_groups=2,
                          conv_kernel=4, chunk_size=16, layers_block_type=["mamba"], vocab_size=16)
    torch.manual_seed(seed)
    m = NemotronHMamba2Mixer(cfg, layer_idx=0)
    with torch.no_grad():  # weights that make every part matter: a slow decay, a varied step and skip
        m.A_log.copy_(torch.linspace(-2.0, 0.5, 4))
        m.dt_bias.copy_(torch.linspace(-1.0, 1.0, 4))
        m.D.copy_(torch.linspace(0.5, 1.5, 4))
        m.norm.weight.copy_(1 + 0.1 * torch.randn(m.norm.weight.shape))
    return m.to(device=device, dtype=dtype)


def per_sequence(m, h: torch.Tensor) -> torch.Tensor:
    return torch.cat([m(h[:, a:b]) for a, b in zip(BOUNDS[:-1], BOUNDS[1:])], dim=1)


def test_one_call_over_a_packed_row_equals_the_mixer_on_each_sequence():
    m = mixer()
    h = torch.randn(1, 45, 32)
    with torch.no_grad():
        got = packed_mamba.mixer_forward(m, h, seq_idx_from_bounds(BOUNDS, 45))
        want = per_sequence(m, h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_segments_it_is_the_mixers_own_forward():
    m = mixer()
    h = torch.randn(2, 45, 32)
    with torch.no_grad():
        torch.testing.assert_close(packed_mamba.mixer_forward(m, h, None), m(h), rtol=1e-5, atol=1e-5)


def test_gradients_of_the_packed_call_equal_those_of_each_sequence_alone():
    m = mixer().train()
    h = torch.randn(1, 45, 32, requires_grad=True)
    w = torch.randn(1, 45, 32)
    (packed_mamba.mixer_forward(m, h, seq_idx_from_bounds(BOUNDS, 45)) * w).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()} | {"input": h.grad.clone()}
    m.zero_grad()
    h.grad = None
    (per_sequence(m, h) * w).sum().backward()
    want = {n: p.grad for n, p in m.named_parameters()} | {"input": h.grad}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_later_sequence_does_not_see_what_came_before_it():
    m = mixer()
    h = torch.randn(1, 45, 32)
    seq = seq_idx_from_bounds(BOUNDS, 45)
    with torch.no_grad():
        base = packed_mamba.mixer_forward(m, h, seq)
        h[:, :30] = torch.randn(1, 30, 32)
        moved = packed_mamba.mixer_forward(m, h, seq)
    torch.testing.assert_close(moved[:, 30:], base[:, 30:], rtol=0, atol=1e-6)


def test_on_cpu_the_torch_scan_runs_and_says_why_not_the_kernels():
    assert packed_mamba.path("cpu") == "torch"
    assert mamba_kernels.load("cpu") is None
    assert "CUDA" in mamba_kernels.why_not("cpu")


def test_the_kernels_are_reached_without_leaving_a_half_imported_mamba_ssm_behind():
    import sys

    mamba_kernels.load()  # None here (no CUDA, or mamba_ssm not installed)
    assert "mamba_ssm" not in sys.modules or not getattr(sys.modules["mamba_ssm"], "__gymv_stand_in__", False)


# -- the Triton kernels (CUDA, with the `kernels` extra installed) ---------------------------------------------

def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor (float32)."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _kernels():
    k = mamba_kernels.load("cuda") if torch.cuda.is_available() else None
    if k is None:
        pytest.skip(f"mamba_ssm's kernels: {mamba_kernels.why_not('cuda' if torch.cuda.is_available() else 'cpu')}")
    return k


def _on_both_paths(m, h, w, kernels, forward) -> tuple[list, list]:
    """([output on `kernels`, on the torch scan], [their gradients: the mixer's parameters and the input]) of
    `forward(kernels)` weighted by `w`."""
    outs, grads = [], []
    for path in (kernels, None):
        m.zero_grad()
        h.grad = None
        y = forward(path)
        (y * w).sum().backward()
        outs.append(y.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()} | {"input": h.grad.clone()})
    return outs, grads


@pytest.mark.gpu
def test_gpu_the_triton_scan_over_a_packed_row_equals_the_torch_scan_forward_and_backward():
    k = _kernels()
    m = mixer(device="cuda", width=16).train()
    h = torch.randn(1, 45, 32, device="cuda", requires_grad=True)
    w = torch.randn(1, 45, 32, device="cuda")
    seq = seq_idx_from_bounds(BOUNDS, 45, "cuda")
    outs, grads = _on_both_paths(m, h, w, k, lambda kernels: packed_mamba.mixer_forward(m, h, seq, kernels))
    # the Triton kernels may multiply float32 in TF32: compared by the norm of the difference
    assert rel_error(outs[0], outs[1]) < 5e-3
    for name in grads[1]:
        assert rel_error(grads[0][name], grads[1][name]) < 1e-2, name


@pytest.mark.gpu
def test_gpu_the_triton_scan_keeps_packed_sequences_apart():
    k = _kernels()
    m = mixer(device="cuda", width=16)
    h = torch.randn(1, 45, 32, device="cuda")
    with torch.no_grad():
        got = packed_mamba.mixer_forward(m, h, seq_idx_from_bounds(BOUNDS, 45, "cuda"), k)
        want = per_sequence(m, h)
    assert rel_error(got, want) < 5e-3


@pytest.mark.gpu
def test_gpu_the_triton_state_update_is_the_static_decoders_torch_step():
    k = _kernels()
    from gymv.backends.generation import static_hybrid as hybrid

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, P, N, G = 3, 4, 16, 16, 2
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    state, x, dt, b, c = r(B, H, P, N), r(B, H, P), r(B, H), r(B, G, N), r(B, G, N)
    a_log, d, dt_bias = r(H), r(H), r(H)
    want_state = state.clone()
    want = hybrid.ssm_update_torch(want_state, x, dt, a_log, b, c, d, dt_bias)
    got = hybrid.ssm_update_triton(k.state_update)(state, x, dt, a_log, b, c, d, dt_bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_the_triton_gated_norm_is_the_mixers_norm_forward_and_backward():
    k = _kernels()
    if k.gated_norm is None:
        pytest.skip("this mamba_ssm has no Triton gated norm (ops/triton/layernorm_gated.rmsnorm_fn)")
    norm = mixer(device="cuda", width=16).norm  # 2 groups of 32 channels
    y = torch.randn(1, 45, 64, device="cuda", requires_grad=True)
    z = torch.randn(1, 45, 64, device="cuda", requires_grad=True)
    w = torch.randn(1, 45, 64, device="cuda")
    outs, grads = [], []
    for kernel in (True, False):
        for t in (y, z, norm.weight):
            t.grad = None
        out = (k.gated_norm(y, norm.weight, None, z=z, eps=norm.variance_epsilon, group_size=norm.group_size,
                            norm_before_gate=False) if kernel else norm(y, z))
        (out * w).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (y, z, norm.weight)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_the_environment_switch_turns_the_kernels_off_with_its_name_as_the_reason(monkeypatch):
    monkeypatch.setenv("GYMV_MAMBA_KERNELS", "0")
    assert mamba_kernels.load("cuda") is None
    assert mamba_kernels.why_not("cuda") == "GYMV_MAMBA_KERNELS=0 in the environment"


@pytest.mark.gpu
def test_gpu_packed_logprobs_on_the_kernels_match_the_torch_scan_in_bfloat16(monkeypatch):
    """The tiny Omni model's packed logprobs (bf16, CUDA) with mamba_ssm's kernels and with gymv's torch scan:
    token_mult_prob_error <= 1.01 between the two."""
    _kernels()
    from family_checks import token_mult_prob_error
    from tiny_models import chat_ids, solid, tiny_path

    from gymv.backends import packed_attention
    from gymv.backends.logprobs import MultimodalBatch, right_pad, token_scores
    from gymv.backends.policy import load_policy

    policy = load_policy(tiny_path("tiny-nemotron-omni"), device="cuda", dtype=torch.bfloat16)
    images = [[solid("red", (64, 48))], [], [solid("blue", (30, 90))]]
    rows = [chat_ids(policy, "How many?", images[0]) + [40, 41, 42], chat_ids(policy, "No picture", images[1]) + [45, 46],
            chat_ids(policy, "Which colour is it?", images[2]) + [43, 44, 47, 48]]
    batch = right_pad(rows, images, 0)
    assert packed_attention.install(policy.model) and packed_mamba.install(policy.model)

    def packed():
        with torch.no_grad():
            return token_scores(policy.model, policy.adapter, MultimodalBatch(
                batch.input_ids.cuda(), batch.attention_mask.cuda(), images), packed=True).logp.float().cpu()

    on_kernels = packed()
    monkeypatch.setenv("GYMV_MAMBA_KERNELS", "0")
    on_torch = packed()
    assert token_mult_prob_error(on_kernels, on_torch, batch.attention_mask.bool()) <= 1.01


def test_the_triton_modules_import_with_the_packages_init_skipped_and_nothing_left_behind(tmp_path, monkeypatch):
    """A package laid out as mamba_ssm's release (an `__init__` that needs a compiled extension, Triton
    modules under ops/triton importing each other by absolute name) imports through the loader, and
    afterwards `import mamba_ssm` fails as it did before (transformers' own lookup sees no stand-in)."""
    import importlib
    import sys

    root = tmp_path / "mamba_ssm"
    (root / "ops" / "triton").mkdir(parents=True)
    (root / "utils").mkdir()
    (root / "__init__.py").write_text("import selective_scan_cuda  # the extension a pure-Python build lacks\n")
    for pkg in (root / "ops", root / "ops" / "triton", root / "utils"):
        (pkg / "__init__.py").write_text("")
    (root / "utils" / "determinism.py").write_text("DETERMINISTIC = False\n")
    (root / "ops" / "triton" / "ssd_combined.py").write_text(
        "from mamba_ssm.utils.determinism import DETERMINISTIC\n"
        "def mamba_chunk_scan_combined(*args, **kwargs):\n    return 'scan'\n")
    (root / "ops" / "triton" / "selective_state_update.py").write_text(
        "def selective_state_update(*args, **kwargs):\n    return 'update'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()

    scan, update = mamba_kernels._import_triton_modules()
    assert scan.mamba_chunk_scan_combined() == "scan" and update.selective_state_update() == "update"
    assert not [k for k in sys.modules if k == "mamba_ssm" or k.startswith("mamba_ssm.")]
    with pytest.raises(ImportError, match="selective_scan_cuda"):
        importlib.import_module("mamba_ssm")
    sys.modules.pop("mamba_ssm", None)


# a prompt of 20 tokens (across the 16-token chunks) held once, then its members' rests: shorter than the
# convolution's window (1 and 2 tokens), and longer than a chunk; then a sequence of its own
SHARED_BOUNDS = [0, 20, 21, 23, 41, 50]
SHARED_PREFIX_OF = [-1, 0, 0, 0, -1]


def shared_sequences(h: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence of the shared row whole, as it would run unpacked: the prompt, then a member's rest."""
    prompt = h[:, 0:20]
    members = [h[:, a:b] for a, b in zip(SHARED_BOUNDS[1:4], SHARED_BOUNDS[2:5])]
    return [torch.cat([prompt, m], dim=1) for m in members] + [h[:, 41:50]]


def shared_forward(m, h: torch.Tensor, kernels=None) -> torch.Tensor:
    plan = mamba_prefix.plan(SHARED_BOUNDS, SHARED_PREFIX_OF, m.conv_kernel_size, h.device)
    return packed_mamba.mixer_forward(m, h, seq_idx_from_bounds(SHARED_BOUNDS, 50, h.device), kernels, plan)


def test_members_of_a_shared_prompt_continue_its_state_as_each_whole_sequence_does():
    m = mixer()
    h = torch.randn(1, 50, 32)
    with torch.no_grad():
        got = shared_forward(m, h)
        alone = [m(s) for s in shared_sequences(h)]
    torch.testing.assert_close(got[:, :20], alone[0][:, :20], rtol=1e-5, atol=1e-5)
    for (a, b), want in zip(zip(SHARED_BOUNDS[1:4], SHARED_BOUNDS[2:5]), alone[:3]):
        torch.testing.assert_close(got[:, a:b], want[:, 20:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 41:], alone[3], rtol=1e-5, atol=1e-5)


def test_gradients_through_a_shared_prompt_add_up_over_its_members():
    m = mixer().train()
    h = torch.randn(1, 50, 32, requires_grad=True)
    w = torch.randn(1, 50, 32)
    (shared_forward(m, h) * w).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()} | {"input": h.grad.clone()}
    m.zero_grad()
    h.grad = None
    loss = 0
    for i, (s, (a, b)) in enumerate(zip(shared_sequences(h)[:3], zip(SHARED_BOUNDS[1:4], SHARED_BOUNDS[2:5]))):
        out = m(s)
        loss = loss + (out[:, 20:] * w[:, a:b]).sum() + ((out[:, :20] * w[:, :20]).sum() if i == 0 else 0)
    loss = loss + (m(shared_sequences(h)[3]) * w[:, 41:]).sum()
    loss.backward()
    want = {n: p.grad for n, p in m.named_parameters()} | {"input": h.grad}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_gpu_members_of_a_shared_prompt_on_the_kernels_equal_the_torch_path_forward_and_backward():
    k = _kernels()
    m = mixer(device="cuda", width=16).train()
    h = torch.randn(1, 50, 32, device="cuda", requires_grad=True)
    w = torch.randn(1, 50, 32, device="cuda")
    outs, grads = _on_both_paths(m, h, w, k, lambda kernels: shared_forward(m, h, kernels))
    with torch.no_grad():
        alone = [m(s) for s in shared_sequences(h)]
    assert rel_error(outs[0][:, 23:41], alone[2][:, 20:]) < 5e-3  # the long member, against its whole sequence
    assert rel_error(outs[0], outs[1]) < 5e-3
    for name in grads[1]:
        assert rel_error(grads[0][name], grads[1][name]) < 1e-2, name


def test_a_prompt_shorter_than_the_convolution_window_is_continued_from_the_rows_start():
    """A 2-token prompt (the window is 4): a member's first taps reach before the prompt, where its whole
    sequence has nothing (zero), not into the row before it."""
    m = mixer()
    bounds = [0, 3, 5, 8, 12]  # a sequence of its own, then a prompt and its two members
    h = torch.randn(1, 12, 32)
    plan = mamba_prefix.plan(bounds, [-1, -1, 1, 1], m.conv_kernel_size)
    with torch.no_grad():
        got = packed_mamba.mixer_forward(m, h, seq_idx_from_bounds(bounds, 12), prefixes=plan)
        prompt = h[:, 3:5]
        for a, b in ((5, 8), (8, 12)):
            want = m(torch.cat([prompt, h[:, a:b]], dim=1))[:, 2:]
            torch.testing.assert_close(got[:, a:b], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[:, :3], m(h[:, :3]), rtol=1e-5, atol=1e-5)
