"""Chunked logprobs and entropies: the same values and gradients as the float32 formulas over the whole
[N, V] logits (forbidden ids, temperature, a forbidden target), chunk by chunk, and a gradient in the
logits' own dtype."""

from __future__ import annotations

import pytest
import torch

from gymv.backends import chunked_scores as cs
from gymv.backends.sampling import forbidden_mask, policy_logits

V = 50
FORBIDDEN = (3, 7, 49)


def _reference(logits, target, forbidden, temperature):
    z = policy_logits(logits, temperature, forbidden)
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, target[:, None]).squeeze(-1) - lse
    lp = torch.where(forbidden[target], torch.zeros_like(lp), lp)
    p = torch.softmax(z, dim=-1)
    ent = lse - (p * z.masked_fill(torch.isinf(z), 0.0)).sum(-1)
    return lp, ent


def _inputs(n=13, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[4] = FORBIDDEN[1]  # an image placeholder as target: scores 0, no gradient
    weights = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return logits, target, weights


@pytest.mark.parametrize("rows_per_chunk", [1, 4, 1000], ids=["row", "chunks", "whole"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_scores_and_gradients_equal_the_whole_vocabulary_formulas(monkeypatch, rows_per_chunk, temperature):
    monkeypatch.setattr(cs, "CHUNK_ELEMENTS", rows_per_chunk * V)
    logits, target, (w_lp, w_ent) = _inputs()
    forbidden = forbidden_mask(V, FORBIDDEN, "cpu")
    a = logits.clone().requires_grad_(True)
    lp, ent, lse = cs.chunked_scores(a, target, forbidden, temperature, entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(b, target, forbidden, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=1e-4)
    assert lp[4] == 0 and not lse.requires_grad
    assert torch.all(a.grad[:, list(FORBIDDEN)] == 0)


def test_logprobs_alone_skip_the_entropy_and_give_the_same_gradient():
    logits, target, (w_lp, _) = _inputs(seed=1)
    forbidden = forbidden_mask(V, FORBIDDEN, "cpu")
    a = logits.clone().requires_grad_(True)
    lp, ent, _ = cs.chunked_scores(a, target, forbidden, 1.0, entropy=False)
    (lp * w_lp).sum().backward()
    b = logits.clone().requires_grad_(True)
    (_reference(b, target, forbidden, 1.0)[0] * w_lp).sum().backward()
    assert ent is None
    torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=1e-4)


def test_bf16_logits_are_scored_in_float32_and_get_a_bf16_gradient():
    logits, target, (w_lp, w_ent) = _inputs(seed=2, dtype=torch.bfloat16)
    a = logits.clone().requires_grad_(True)
    lp, ent, _ = cs.chunked_scores(a, target, None, 1.0, entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = logits.float().requires_grad_(True)
    z = b
    lse = torch.logsumexp(z, -1)
    ref_lp = z.gather(-1, target[:, None]).squeeze(-1) - lse
    ref_ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32 and a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=1e-6)  # the same float32 math on the same inputs
    torch.testing.assert_close(a.grad.float(), b.grad, atol=1e-2, rtol=1e-2)  # one bf16 rounding


@pytest.mark.gpu
def test_gpu_the_kernel_equals_the_torch_chunks_at_a_131k_vocabulary(monkeypatch):
    """gymv.backends.scores_kernel on CUDA (bf16 logits, forbidden ids, temperature 0.8) against the chunks
    with GYMV_SCORES_KERNEL=0: logprobs, entropies and the logits' gradient."""
    from gymv.backends import scores_kernel

    if not scores_kernel.available():
        pytest.skip("triton does not import")
    g = torch.Generator().manual_seed(5)
    vocab = 131072
    logits = (3 * torch.randn(512, vocab, generator=g)).to("cuda", torch.bfloat16)
    target = torch.randint(0, vocab, (512,), generator=g).cuda()
    forbidden = forbidden_mask(vocab, [7, 8, 9], "cuda")
    w = torch.randn(512, generator=g).cuda()

    def run(switch):
        monkeypatch.setenv(cs.SWITCH, switch)
        assert cs.kernel_on(logits) is (switch == "1")  # on, once its one-time check passed
        x = logits.clone().requires_grad_()
        lp, ent, _ = cs.chunked_scores(x, target, forbidden, 0.8, True)
        ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    got, want = run("1"), run("0")
    for name, a, b in zip(["logprobs", "entropies", "gradient"], got, want):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2, name
