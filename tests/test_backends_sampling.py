"""Drawing a token from the policy distribution (gymv.backends.sampling.sample)."""

from __future__ import annotations

import torch

from gymv.backends.sampling import forbidden_mask, policy_logits, sample


def draws(probs: list[float], n: int = 100_000, seed: int = 0, top_p: float = 1.0) -> torch.Tensor:
    z = torch.tensor(probs).log().expand(n, -1)
    return sample(z, top_p, greedy=False, generator=torch.Generator().manual_seed(seed))


def test_draws_follow_the_distribution():
    freq = torch.bincount(draws([0.5, 0.3, 0.15, 0.05]), minlength=4).double() / 100_000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=0.006)


def test_a_forbidden_token_is_never_drawn_wherever_it_sits_in_the_vocabulary():
    z = torch.randn(20_000, 6).mul(3)
    forbidden = forbidden_mask(6, [0, 2, 5], z.device)  # first, middle and last id
    tok = sample(policy_logits(z, 1.0, forbidden), 1.0, greedy=False, generator=torch.Generator().manual_seed(1))
    assert not forbidden[tok].any()
    assert set(tok.tolist()) == {1, 3, 4}


def test_top_p_draws_only_from_the_nucleus():
    assert set(draws([0.5, 0.3, 0.15, 0.05], n=20_000, top_p=0.7).tolist()) == {0, 1}


def test_the_same_generator_seed_gives_the_same_draws():
    assert torch.equal(draws([0.4, 0.6], n=64, seed=3), draws([0.4, 0.6], n=64, seed=3))
    assert not torch.equal(draws([0.4, 0.6], n=64, seed=3), draws([0.4, 0.6], n=64, seed=4))


def test_greedy_takes_the_most_likely_token():
    assert sample(torch.tensor([[0.1, 2.0, 1.0]]), 1.0, greedy=True, generator=None).tolist() == [1]
