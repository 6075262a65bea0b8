"""Truncated importance weights and ICE-POP against behaviour logprobs, as NeMo RL defines them."""

import math

import pytest
import torch

from gymv.algorithms.importance import icepop_gate, icepop_weights, seq_mask_tis_weights, truncated_is_weights

L = math.log
# trainer-old logprob .5 everywhere; behaviour probabilities give rho = .5 / p_behaviour
OLD = torch.full((1, 5), L(0.5))
BEHAVIOUR = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.05, 1.0]]))  # rho = 1, 2, 5, 10, 0.5
MASK = torch.ones(1, 5, dtype=torch.bool)


def test_truncated_weights_are_rho_capped_at_truncate_max():
    w = truncated_is_weights(OLD, BEHAVIOUR, MASK, truncate_max=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 2.0, 2.0, 0.5])


def test_truncated_weights_are_rho_clamped_to_truncate_min_and_truncate_max():
    """NeMo RL's tis with truncated_importance_sampling_ratio_min 0.6 (the Super Omni GRPO recipe: 0.5)."""
    w = truncated_is_weights(OLD, BEHAVIOUR, MASK, truncate_max=2.0, truncate_min=0.6)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 2.0, 2.0, 0.6])


def test_weights_are_zero_off_the_mask():
    w = truncated_is_weights(OLD, BEHAVIOUR, torch.tensor([[True, False, True, True, True]]), truncate_max=10.0)
    assert w[0, 1].item() == 0.0


def test_gate_keeps_tokens_with_ratio_inside_the_bounds_inclusive():
    assert icepop_gate(OLD, BEHAVIOUR, MASK).tolist() == [[True, True, True, False, True]]


def test_gate_drops_tokens_below_the_lower_bound():
    behaviour = torch.log(torch.tensor([[0.5]]))
    old = torch.log(torch.tensor([[0.05]]))  # rho = 0.1
    assert icepop_gate(old, behaviour, torch.ones(1, 1, dtype=torch.bool)).tolist() == [[False]]


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_()
    assert not truncated_is_weights(old, BEHAVIOUR, MASK).requires_grad


def test_icepop_weights_are_rho_inside_the_bounds_and_zero_outside():
    w, kept = icepop_weights(OLD, BEHAVIOUR, MASK, 0.2, 5.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 5.0, 0.0, 0.5])
    assert kept.tolist() == [[True, True, True, False, True]]


def test_a_behaviour_logprob_of_minus_infinity_weighs_its_token_0():
    behaviour = torch.tensor([[-math.inf]])
    assert truncated_is_weights(torch.zeros(1, 1), behaviour, torch.ones(1, 1, dtype=torch.bool)).item() == 0.0


def test_seq_mask_tis_keeps_raw_rho_on_sequences_whose_geometric_mean_rho_is_inside_the_bounds():
    """NeMo RL's seq-mask-tis with its reference bounds 0.999 and 1.002: rho 2 and 0.5 (geometric mean 1) keep
    their raw, unclamped weights; rho 2 and 2 (geometric mean 2) drop the whole sequence."""
    old = torch.full((2, 2), L(0.5))
    behaviour = torch.log(torch.tensor([[0.25, 1.0], [0.25, 0.25]]))
    w, kept = seq_mask_tis_weights(old, behaviour, torch.ones(2, 2, dtype=torch.bool), 0.999, 1.002)
    assert w.tolist() == [pytest.approx([2.0, 0.5]), [0.0, 0.0]]
    assert kept.tolist() == [True, False]


def test_seq_mask_tis_takes_the_geometric_mean_over_the_masked_tokens_only():
    old = torch.full((1, 3), L(0.5))
    behaviour = torch.log(torch.tensor([[0.01, 0.25, 1.0]]))  # rho 50 off the mask, then 2 and 0.5
    _, kept = seq_mask_tis_weights(old, behaviour, torch.tensor([[False, True, True]]), 0.999, 1.002)
    assert kept.tolist() == [True]
