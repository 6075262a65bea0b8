"""The Triton segment-masked causal convolution against gymv's torch one (ssd_scan.segment_conv1d), forward and
every gradient, run by triton's CPU interpreter.

Triton picks its interpreter when it is first imported, so the kernels run in a child process started with
TRITON_INTERPRET=1 (one for the whole module). The rows are packed: several sequences, one shorter than the
kernel, a row tail that is not a whole tile, channels that are not a whole tile. On a GPU the `gpu` test
checks the compiled kernel at the Nano's widths.
"""

from __future__ import annotations

import textwrap

import pytest

from triton_interpreter import assert_within, run_interpreted

pytest.importorskip("triton")

CHILD = textwrap.dedent("""
    import json, torch
    from gymv.backends import conv_kernel
    from gymv.backends.conv_kernel import segment_conv1d_triton
    from gymv.backends.ssd_scan import segment_conv1d, seq_idx_from_bounds

    def run(conv, x, w, b, seq_idx, act, r):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        b = b.clone().requires_grad_() if b is not None else None
        out = conv(x, w, b, seq_idx, activation=act)
        (out.float() * r).sum().backward()
        return [out, x.grad, w.grad] + ([b.grad] if b is not None else [])

    def errors(dtype, K=4, bias=True, segments=True, act="silu", L=37, C=20, wide=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, dtype)
        x = torch.randn(2, L, C + 8 if wide else C, generator=g).to(dt)
        if wide:  # the channels a slice of a wider tensor, as a split of the input projection
            x = x[..., 3:3 + C]
        w = (torch.randn(C, K, generator=g) * 0.5).to(dt)
        b = torch.randn(C, generator=g).to(dt) if bias else None
        seq_idx = None
        if segments:  # sequences of 5, 1, 2, 12 and 17 tokens; the second row one sequence and a short one
            seq_idx = torch.cat([seq_idx_from_bounds([0, 5, 6, 8, 20, L], L),
                                 seq_idx_from_bounds([0, L - 3, L], L)])
        r = torch.randn(2, L, C, generator=g)
        got = run(segment_conv1d_triton, x, w, b, seq_idx, act, r)
        want = run(segment_conv1d, x, w, b, seq_idx, act, r)
        names = ["out", "dx", "dweight", "dbias"]
        ok = all(a.dtype == e.dtype and a.shape == e.shape for a, e in zip(got, want))
        return {n: ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1)).item() if ok else None
                for n, a, e in zip(names, got, want)}

    out = {}
    for dtype in ("float32", "bfloat16"):
        out[f"{dtype}/all"] = errors(dtype)
        out[f"{dtype}/plain"] = errors(dtype, bias=False, segments=False, act=None)
        out[f"{dtype}/segments_no_act"] = errors(dtype, bias=False, act=None, seed=1)
        out[f"{dtype}/bias_silu_no_segments"] = errors(dtype, segments=False, seed=2)
    for K in (2, 3):
        out[f"float32/K{K}"] = errors("float32", K=K, seed=K)
    out["float32/wide_slice"] = errors("float32", wide=True, seed=5)
    conv_kernel.TARGET_PROGRAMS = 1  # one backward program per channel block walks every tile of the row
    out["float32/one_span"] = errors("float32", L=75, seed=6)
    # the mixer's own call: mamba_kernels.causal_conv picks the kernel where causal_conv1d is absent (the scan
    # on torch's, as the interpreter runs no mamba_ssm), against the torch mixer, forward and input gradient
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    from gymv.backends.mamba_kernels import Kernels
    from gymv.backends.packed_mamba import mixer_forward
    from gymv.backends.ssd_scan import chunk_scan

    torch.manual_seed(0)
    m = NemotronHMamba2Mixer(NemotronHConfig(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                                             n_groups=2, conv_kernel=4, chunk_size=16, layers_block_type=["mamba"],
                                             vocab_size=16), layer_idx=0)
    h = torch.randn(1, 45, 32)
    seq_idx = seq_idx_from_bounds([0, 7, 8, 30, 45], 45)
    kernels = Kernels(chunk_scan, None, None, segment_conv=segment_conv1d_triton)
    mixed = []
    for k in (kernels, None):
        x = h.clone().requires_grad_()
        y = mixer_forward(m, x, seq_idx, k)
        y.square().sum().backward()
        mixed.append((y.detach(), x.grad))
    out["mixer"] = [(a - b).abs().max().item() for a, b in zip(*mixed)]
    out["empty"] = list(segment_conv1d_triton(torch.zeros(2, 0, 8), torch.zeros(8, 4), activation="silu").shape)
    try:
        segment_conv1d_triton(torch.zeros(1, 4, 8), torch.zeros(8, 4), activation="gelu")
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
def test_packed_rows_with_bias_and_silu_match_the_torch_convolution_forward_and_backward(interpreted, dtype):
    _check(interpreted, f"{dtype}/all")
    assert set(interpreted[f"{dtype}/all"]) == {"out", "dx", "dweight", "dbias"}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_no_bias_no_segments_no_activation_match(interpreted, dtype):
    _check(interpreted, f"{dtype}/plain")


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_segments_without_activation_match(interpreted, dtype):
    _check(interpreted, f"{dtype}/segments_no_act")


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_bias_and_silu_over_one_sequence_match(interpreted, dtype):
    _check(interpreted, f"{dtype}/bias_silu_no_segments")


@pytest.mark.parametrize("K", [2, 3])
def test_kernels_shorter_than_four_taps_match(interpreted, K):
    _check(interpreted, f"float32/K{K}")


def test_channels_sliced_from_a_wider_tensor_match(interpreted):
    _check(interpreted, "float32/wide_slice")


def test_a_backward_program_walking_several_tiles_sums_its_gradients_across_them(interpreted):
    _check(interpreted, "float32/one_span")


def test_the_mixer_runs_its_convolution_on_the_kernel_where_causal_conv1d_is_absent(interpreted):
    assert max(interpreted["mixer"]) < 1e-5, interpreted["mixer"]


def test_an_empty_row_gives_an_empty_result(interpreted):
    assert interpreted["empty"] == [2, 0, 8]


def test_an_activation_other_than_silu_is_refused(interpreted):
    assert interpreted["refused"] and "gelu" in interpreted["refused"]


@pytest.mark.gpu
def test_the_compiled_kernel_matches_the_torch_convolution_at_the_nano_widths():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gymv.backends.conv_kernel import segment_conv1d_triton
    from gymv.backends.ssd_scan import segment_conv1d, seq_idx_from_bounds

    torch.manual_seed(0)
    L, C = 4096, 4096 + 2 * 8 * 128
    proj = torch.randn(1, L, 2 * C, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(C, 4, device="cuda") * 0.5).to(torch.bfloat16)
    b = torch.randn(C, device="cuda", dtype=torch.bfloat16)
    seq_idx = seq_idx_from_bounds([0, 1000, 1002, 2500, L - 7, L], L, "cuda")
    r = torch.randn(1, L, C, device="cuda")
    results = []
    for conv, dtype in ((segment_conv1d_triton, torch.bfloat16), (segment_conv1d, torch.float32)):
        x = proj[..., 5:5 + C].to(dtype).requires_grad_()  # a slice, as the input projection's split is
        wi, bi = w.detach().to(dtype).requires_grad_(), b.detach().to(dtype).requires_grad_()  # leaves each pass
        out = conv(x, wi, bi, seq_idx, activation="silu")
        (out.float() * r).sum().backward()
        results.append([t.float() for t in (out, x.grad, wi.grad, bi.grad)])
    for name, got, want in zip(("out", "dx", "dweight", "dbias"), *results):
        err = ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()
        assert err < 2e-2, (name, err)
