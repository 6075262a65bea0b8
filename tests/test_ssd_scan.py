"""gymv.backends.ssd_scan: the torch Mamba-2 scan and convolution with sequence resets, against
transformers' own torch reference run one sequence at a time (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import causal_conv1d_fn, mamba2_chunk_scan

from gymv.backends.ssd_scan import chunk_scan, segment_conv1d, seq_idx_from_bounds

BOUNDS = [0, 5, 6, 20, 37]  # a one-token sequence, and sequences across chunk boundaries (chunk 8)
H, P, G, N, CHUNK = 4, 3, 2, 5, 8


def _inputs(batch=2, length=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(batch, length, H, P), dt=r(batch, length, H), A=-torch.rand(H, generator=g) - 0.5,
                B=r(batch, length, G, N), C=r(batch, length, G, N), D=r(H), dt_bias=r(H))


def test_seq_idx_numbers_each_token_by_its_sequence():
    assert seq_idx_from_bounds([0, 2, 3, 6], 7).tolist() == [[0, 0, 1, 2, 2, 2, 2]]


def test_scan_without_segments_is_transformers_reference():
    t = _inputs()
    init = torch.randn(2, H, P, N)
    want, want_state = mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, D=t["D"],
                                         dt_bias=t["dt_bias"], dt_softplus=True, initial_states=init,
                                         return_final_states=True)
    got, state = chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, initial_states=init, return_final_states=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def _per_sequence(t):
    ys, state = [], None
    for a, b in zip(BOUNDS[:-1], BOUNDS[1:]):
        part = {k: (v[:, a:b] if v.dim() > 1 else v) for k, v in t.items()}
        y, state = mamba2_chunk_scan(part["x"], part["dt"], part["A"], part["B"], part["C"], CHUNK, D=part["D"],
                                     dt_bias=part["dt_bias"], dt_softplus=True, return_final_states=True)
        ys.append(y)
    return torch.cat(ys, dim=1), state


def test_one_call_over_a_packed_row_equals_each_sequence_alone():
    t = _inputs()
    seq = seq_idx_from_bounds(BOUNDS, 37).expand(2, -1)
    got, state = chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq, return_final_states=True)
    want, want_state = _per_sequence(t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def test_packed_scan_gradients_equal_each_sequence_alone():
    t = {k: v.requires_grad_() for k, v in _inputs().items()}
    seq = seq_idx_from_bounds(BOUNDS, 37).expand(2, -1)
    w = torch.randn(2, 37, H, P)
    (chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq) * w).sum().backward()
    got = {k: v.grad.clone() for k, v in t.items()}
    for v in t.values():
        v.grad = None
    (_per_sequence(t)[0] * w).sum().backward()
    for k, v in t.items():
        torch.testing.assert_close(got[k], v.grad, rtol=1e-4, atol=1e-4, msg=k)


def test_a_later_sequence_does_not_see_an_earlier_one():
    t = _inputs(batch=1)
    seq = seq_idx_from_bounds(BOUNDS, 37)
    base = chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq)
    t["x"][:, :20] += 5.0  # change the first three sequences only
    moved = chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq)
    torch.testing.assert_close(moved[:, 20:], base[:, 20:], rtol=0, atol=1e-5)
    assert not torch.allclose(moved[:, :20], base[:, :20])


def test_segment_conv_equals_each_sequence_convolved_alone():
    x, w, b = torch.randn(2, 37, 6), torch.randn(6, 4), torch.randn(6)
    got = segment_conv1d(x, w, b, seq_idx_from_bounds(BOUNDS, 37).expand(2, -1), activation="silu")
    want = torch.cat([causal_conv1d_fn(x[:, a:e].transpose(1, 2), w, b, activation="silu").transpose(1, 2)
                      for a, e in zip(BOUNDS[:-1], BOUNDS[1:])], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_segment_conv_without_segments_is_a_causal_conv():
    x, w = torch.randn(1, 9, 3), torch.randn(3, 4)
    want = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=3, groups=3)[..., :9].transpose(1, 2)
    torch.testing.assert_close(segment_conv1d(x, w), want, rtol=1e-5, atol=1e-6)


def test_seq_idx_of_the_wrong_shape_is_refused():
    t = _inputs(batch=1)
    with pytest.raises(ValueError, match="seq_idx must be"):
        chunk_scan(**t, chunk_size=CHUNK, seq_idx=torch.zeros(1, 5, dtype=torch.int32))


def test_a_row_of_one_sequence_is_all_zeros():
    assert seq_idx_from_bounds([0, 4], 4).tolist() == [[0, 0, 0, 0]]


def test_initial_states_start_the_first_sequence_only():
    t = _inputs(batch=1)
    init = torch.randn(1, H, P, N)
    seq = seq_idx_from_bounds(BOUNDS, 37)
    got = chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq, initial_states=init)
    first = {k: (v[:, :5] if v.dim() > 1 else v) for k, v in t.items()}
    want_first = mamba2_chunk_scan(first["x"], first["dt"], first["A"], first["B"], first["C"], CHUNK, D=first["D"],
                                   dt_bias=first["dt_bias"], dt_softplus=True, initial_states=init)
    torch.testing.assert_close(got[:, :5], want_first, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 5:], chunk_scan(**t, chunk_size=CHUNK, dt_softplus=True, seq_idx=seq)[:, 5:],
                               rtol=1e-5, atol=1e-5)
