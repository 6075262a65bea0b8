"""Clipped policy loss, KL estimators, REINFORCE/NLL, and aggregation over the global batch."""

import math

import pytest
import torch

from gymv.algorithms.losses import GlobalCounts, aggregate, clipped_policy_loss, kl_penalty, reinforce_loss
from gymv.errors import GymvError

L = math.log


def policy(ratio, adv, eps_low=0.2, eps_high=0.2):
    logp = torch.tensor([[L(0.5 * ratio)]], requires_grad=True)
    old = torch.tensor([[L(0.5)]])
    loss, clipped = clipped_policy_loss(logp, old, torch.tensor([adv]), torch.tensor([[True]]), eps_low, eps_high)
    loss.sum().backward()
    return loss.item(), bool(clipped.item()), logp.grad.item()


def test_positive_advantage_is_clipped_above_one_plus_eps():
    assert policy(1.5, 1.0)[:2] == (pytest.approx(-1.2), True)


def test_negative_advantage_with_high_ratio_is_not_clipped():
    assert policy(1.5, -1.0)[:2] == (pytest.approx(1.5), False)


def test_negative_advantage_is_clipped_below_one_minus_eps():
    assert policy(0.5, -1.0)[:2] == (pytest.approx(0.8), True)


def test_positive_advantage_with_low_ratio_is_not_clipped():
    assert policy(0.5, 1.0)[:2] == (pytest.approx(-0.5), False)


def test_eps_high_is_independent_of_eps_low():
    assert policy(1.5, 1.0, eps_low=0.2, eps_high=0.28)[0] == pytest.approx(-1.28)
    assert policy(0.5, -1.0, eps_low=0.1, eps_high=0.28)[0] == pytest.approx(0.9)


def test_clipped_tokens_get_no_gradient_and_unclipped_get_minus_a_ratio():
    assert policy(1.5, 1.0)[2] == 0.0
    assert policy(1.5, -1.0)[2] == pytest.approx(1.5)  # d(-ratio*A)/dlogp = -A*ratio


def test_per_token_advantages_are_accepted():
    logp = torch.zeros(1, 2)
    loss, _ = clipped_policy_loss(logp, logp, torch.tensor([[1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert loss.tolist() == [[-1.0, 2.0]]


@pytest.mark.parametrize("estimator,value", [("k1", L(2)), ("k2", 0.5 * L(2) ** 2), ("k3", 0.5 + L(2) - 1)])
def test_kl_estimators(estimator, value):
    # logp = log .5, ref = log .25: d = ref - logp = -log 2
    kl = kl_penalty(torch.tensor([[L(0.5)]]), torch.tensor([[L(0.25)]]), torch.tensor([[True]]), estimator)
    assert kl.item() == pytest.approx(value)


def test_unknown_kl_estimator_is_an_error_naming_the_registered_ones():
    with pytest.raises(GymvError, match="unknown KL estimator 'k4'") as e:
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k4")
    assert e.value.fix == "use one of: k1, k2, k3"


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,value", [("token_mean", 2.5), ("seq_mean_token_mean", 3.0), ("seq_mean_token_sum", 5.0)])
def test_aggregation_modes(mode, value):
    assert aggregate(PER_TOKEN, MASK, mode).item() == pytest.approx(value)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batch_shares_with_global_counts_sum_to_the_full_batch_value(mode):
    counts = GlobalCounts.of(MASK)
    parts = aggregate(PER_TOKEN[:1], MASK[:1], mode, counts) + aggregate(PER_TOKEN[1:], MASK[1:], mode, counts)
    assert parts.item() == pytest.approx(aggregate(PER_TOKEN, MASK, mode).item())


def test_global_counts_skip_sequences_without_valid_tokens():
    assert GlobalCounts.of(torch.tensor([[1, 1], [0, 0], [0, 1]])) == GlobalCounts(tokens=3.0, sequences=2.0)


def test_masked_minus_inf_neither_leaks_into_the_value_nor_the_gradient():
    logp = torch.tensor([[float("-inf"), L(0.5)]], requires_grad=True)
    mask = torch.tensor([[False, True]])
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask)
    total = aggregate(loss, mask)
    total.backward()
    assert total.item() == -1.0
    assert logp.grad.tolist() == [[0.0, -1.0]]


def test_unknown_aggregation_is_an_error():
    with pytest.raises(GymvError, match="unknown loss aggregation 'sum'"):
        aggregate(PER_TOKEN, MASK, "sum")


def test_reinforce_gradient_is_minus_advantage():
    logp = torch.tensor([[L(0.25), L(0.5)]], requires_grad=True)
    loss = reinforce_loss(logp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    loss.sum().backward()
    assert loss.tolist() == [[-2.0, 1.0]]
    assert logp.grad.tolist() == [[-2.0, 1.0]]
