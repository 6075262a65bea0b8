"""Token-budget micro-batch planning and the default padding collate."""

import pytest
import torch

from gymv.backends.training.micro_batches import pad_collate, plan_micro_batches, plan_shared_prefix_micro_batches
from gymv.errors import GymvError


def padded_cost(plan, lengths):
    return [len(b) * max(lengths[i] for i in b) for b in plan]


def test_every_micro_batch_stays_within_the_padded_token_budget():
    lengths = [3, 9, 4, 7, 2, 8, 5, 6, 1]
    plan = plan_micro_batches(lengths, 16)
    assert all(c <= 16 for c in padded_cost(plan, lengths))
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))


def test_samples_are_bucketed_longest_first():
    assert plan_micro_batches([2, 8, 3, 7], 16) == [[1, 3], [2, 0]]


def test_a_sample_longer_than_the_budget_runs_alone():
    assert plan_micro_batches([50, 2, 2], 10) == [[0], [1, 2]]


def test_a_non_positive_budget_is_an_error():
    with pytest.raises(GymvError, match="micro_batch_tokens"):
        plan_micro_batches([1], 0)


def test_collate_right_pads_sequences_and_stacks_scalars():
    mb = pad_collate([
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([False, True, True]), "advantages": torch.tensor(1.0)},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([True]), "advantages": torch.tensor(-1.0)},
    ])
    assert mb["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mb["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert mb["advantages"].tolist() == [1.0, -1.0]
    assert mb["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_collate_uses_given_pad_values():
    mb = pad_collate([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3])}], pad_values={"input_ids": 99})
    assert mb["input_ids"].tolist() == [[1, 2], [3, 99]]


def test_collate_rejects_samples_with_different_fields():
    with pytest.raises(RuntimeError, match="sample 1"):
        pad_collate([{"input_ids": torch.tensor([1])}, {"input_ids": torch.tensor([1]), "x": torch.tensor(0.0)}])


def shared_cost(plan, prefixes, lengths):
    """Distinct prefixes x longest prefix + samples x longest remainder, per micro-batch."""
    out = []
    for b in plan:
        keys = {prefixes[i] for i in b}
        out.append(len(keys) * max(k[0] for k in keys) + len(b) * max(lengths[i] - prefixes[i][0] for i in b))
    return out


def test_a_groups_samples_share_a_micro_batch_whose_prompt_counts_once():
    a, b = (70, "prompt a"), (72, "prompt b")
    prefixes = [a, b, a, b, a, b]
    lengths = [75, 80, 78, 74, 71, 79]
    plan = plan_shared_prefix_micro_batches(prefixes, lengths, 2 * 72 + 6 * 8)
    assert plan == [[2, 0, 4, 1, 5, 3]]  # prefix a's samples first, each prefix's longest remainder first
    assert shared_cost(plan, prefixes, lengths) == [2 * 72 + 6 * 8]


def test_shared_prefix_micro_batches_stay_within_the_budget_and_cover_every_sample():
    prefixes = [(60 + i % 3, f"p{i % 3}") for i in range(12)]
    lengths = [p[0] + 1 + (7 * i) % 5 for i, p in enumerate(prefixes)]
    plan = plan_shared_prefix_micro_batches(prefixes, lengths, 150)
    assert len(plan) > 1 and all(c <= 150 for c in shared_cost(plan, prefixes, lengths))
    assert sorted(i for mb in plan for i in mb) == list(range(12))


def test_a_sample_without_a_shareable_prefix_gets_the_padded_plan():
    lengths = [75, 80, 78]
    plan = plan_shared_prefix_micro_batches([(70, "a"), None, (70, "a")], lengths, 160)
    assert plan == plan_micro_batches(lengths, 160)
