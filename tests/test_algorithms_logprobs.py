"""The shared logprob convention: temperature-scaled log_softmax, forbidden ids removed, shifted by one."""

import math

import pytest
import torch

from gymv.algorithms.logprobs import logprobs_from_logits


def test_entry_t_scores_token_t_from_the_logits_at_t_minus_1():
    logits = torch.tensor([[[0.0, 0.0, 0.0], [5.0, 0.0, 0.0]]])
    logp, _ = logprobs_from_logits(logits, torch.tensor([[2, 1]]))
    assert logp.tolist()[0] == pytest.approx([0.0, math.log(1 / 3)])


def test_temperature_divides_the_logits():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    logp, _ = logprobs_from_logits(logits, torch.tensor([[1, 0]]), temperature=2.0)
    assert logp[0, 1].item() == pytest.approx(1.0 - math.log(math.e + 2))


def test_forbidden_ids_are_removed_from_the_distribution():
    logits = torch.zeros(1, 2, 3)
    logp, ent = logprobs_from_logits(logits, torch.tensor([[0, 0]]), forbidden_ids=[2], with_entropy=True)
    assert logp[0, 1].item() == pytest.approx(math.log(0.5))
    assert ent[0, 1].item() == pytest.approx(math.log(2))


def test_a_forbidden_target_gets_minus_inf():
    logp, _ = logprobs_from_logits(torch.zeros(1, 2, 3), torch.tensor([[0, 2]]), forbidden_ids=[2])
    assert logp[0, 1].item() == float("-inf")


def test_entropy_of_a_uniform_distribution_is_log_v():
    _, ent = logprobs_from_logits(torch.zeros(1, 2, 4), torch.tensor([[0, 1]]), with_entropy=True)
    assert ent[0, 1].item() == pytest.approx(math.log(4))
