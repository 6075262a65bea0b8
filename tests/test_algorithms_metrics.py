"""Health metrics: token_mult_prob_error, entropy, fractions, weight stats."""

import math

import pytest
import torch

from gymv.algorithms.metrics import entropy_mean, fraction, token_mult_prob_error, weight_stats

L = math.log


def test_token_mult_prob_error_per_sample_and_batch():
    gen = torch.tensor([[0.0, L(0.5), L(0.25)], [0.0, L(0.1), 0.0]])
    train = torch.tensor([[0.0, L(0.25), L(0.25)], [0.0, L(0.1), 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    per_sample, batch = token_mult_prob_error(gen, train, mask)
    assert per_sample.tolist() == pytest.approx([1.5, 1.0])  # exp(log 2) = 2 and 1 -> 1.5
    assert batch.item() == pytest.approx(4 / 3)  # mean over the three generated tokens


def test_token_mult_prob_error_is_one_when_backends_agree():
    x = torch.randn(3, 5)
    _, batch = token_mult_prob_error(x, x.clone(), torch.ones(3, 5))
    assert batch.item() == 1.0


def test_token_mult_prob_error_ignores_masked_minus_inf():
    gen = torch.tensor([[float("-inf"), 0.0]])
    per_sample, batch = token_mult_prob_error(gen, torch.zeros(1, 2), torch.tensor([[0, 1]]))
    assert per_sample.tolist() == [1.0] and batch.item() == 1.0


def test_entropy_mean_over_generated_tokens():
    assert entropy_mean(torch.tensor([[9.0, 1.0, 2.0]]), torch.tensor([[0, 1, 1]])).item() == 1.5


def test_fraction_of_flagged_tokens():
    assert fraction(torch.tensor([[True, False, True, True]]), torch.tensor([[1, 1, 1, 0]])).item() == pytest.approx(2 / 3)


def test_weight_stats_mean_and_max():
    s = weight_stats(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    assert (s["mean"].item(), s["max"].item()) == (2.0, 3.0)
