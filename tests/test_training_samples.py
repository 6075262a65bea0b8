"""The training-sample contract: one builder for SFT, GRPO and MOPD samples, dtypes from one table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gymv.algorithms.mopd import distillation_samples
from gymv.backends.training.samples import FIELDS, as_tensors, training_sample
from gymv.train.stats import policy_samples


def traj(n=4, error=None):
    return SimpleNamespace(token_ids=list(range(10, 10 + n)), loss_mask=[0, 0, 1, 1][:n], logprobs=[0.0, 0.0, -0.5, -0.25][:n],
                           images=[], error=error, task_index=3, sample_index=1, agent_name="a", reward=1.0)


def test_a_grpo_sample_becomes_tensors_of_the_contracts_dtypes():
    (s,) = policy_samples([traj(), traj(error="boom")], [0.5, 0.0])
    assert set(s) == {"input_ids", "loss_mask", "logp_behaviour", "advantages", "images", "where"}
    t = as_tensors(s)
    assert (t["input_ids"].dtype, t["loss_mask"].dtype, t["logp_behaviour"].dtype) == (torch.long, torch.bool, torch.float32)
    assert t["advantages"].shape == () and t["where"] == "row 3 sample 1"


def test_a_mopd_sample_carries_the_teachers_scores_and_top_k_under_contract_keys():
    lp = {"logp": torch.tensor([0.0, -1.0, -2.0, -3.0], dtype=torch.bfloat16),
          "topk_ids": torch.zeros(4, 2, dtype=torch.int32), "topk_logp": torch.zeros(4, 2)}
    (s,) = distillation_samples([traj()], [lp], [0.1])
    assert set(s) - {"images", "where"} <= set(FIELDS)
    t = as_tensors(s)
    assert t["logp_teacher"].tolist() == [0.0, -1.0, -2.0, -3.0] and t["teacher_topk_ids"].dtype == torch.long


def test_a_key_outside_the_contract_is_a_bug_not_a_silent_float():
    with pytest.raises(RuntimeError, match="not in the sample contract"):
        as_tensors({"input_ids": [1, 2], "logp_student_topk": [0.0, 0.0]})


def test_fields_of_another_length_than_the_tokens_are_an_internal_error():
    with pytest.raises(AssertionError, match="loss_mask has 1 entries for 2 tokens"):
        training_sample([1, 2], [True], where="row 0")
