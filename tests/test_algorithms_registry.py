"""Advantage baselines, KL estimators and loss aggregations are registries: a registered function is a valid
recipe value and the loss uses it; the schema names the registered choices of a bad value."""

from __future__ import annotations

import pytest
import torch

from gymv.algorithms.advantages import grpo_advantages
from gymv.algorithms.loss_fns import PolicyLoss
from gymv.algorithms.losses import GlobalCounts, kl_penalty
from gymv.algorithms.registry import BASELINES, KL_ESTIMATORS, register_baseline, register_kl_estimator
from gymv.config import validate_config
from gymv.config.schema import MODELS
from gymv.errors import GymvError


def abs_kl(logp, logp_ref):
    return (logp - logp_ref).abs()


def group_max(rewards, group_ids, valid, *, std):
    """Each sample against the best reward of its group."""
    best = torch.stack([rewards[(group_ids == g) & valid].max() for g in group_ids.tolist()])
    return best, torch.zeros_like(rewards), valid


@pytest.fixture
def abs_estimator():
    register_kl_estimator("abs")(abs_kl)
    yield "abs"
    KL_ESTIMATORS.unregister("abs")


def grpo(**loss_and_advantage):
    return MODELS["grpo"].model_validate({"algorithm": "grpo", "grpo": loss_and_advantage})


def test_a_registered_kl_estimator_is_a_valid_recipe_value_and_the_loss_uses_it(abs_estimator):
    cfg = grpo(loss={"kl_estimator": abs_estimator, "kl_coef": 1.0})
    assert cfg.grpo.loss.kl_estimator == "abs"
    logp, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-3.0, -2.5]]), torch.tensor([[1, 0]])
    assert kl_penalty(logp, ref, mask, "abs").tolist() == [[2.0, 0.0]]


def test_a_loss_names_a_function_registered_in_this_process_by_its_import_path(abs_estimator):
    """The training workers run in other processes, where only the path finds it."""
    loss = PolicyLoss(kl_coef=1.0, kl_estimator=abs_estimator)
    assert loss.kl_estimator.endswith("test_algorithms_registry:abs_kl")
    batch = {"loss_mask": torch.ones(1, 2), "advantages": torch.zeros(1), "logp_ref": torch.tensor([[-3.0, -2.5]])}
    _, metrics = loss(batch, torch.tensor([[-1.0, -2.0]]), None, GlobalCounts(tokens=2, sequences=1))
    assert metrics["kl_ref"].item() == pytest.approx(1.25)
    assert PolicyLoss().kl_estimator == "k3"  # a built-in keeps its name


def test_a_registered_baseline_is_a_valid_recipe_value_and_grpo_advantages_use_it():
    register_baseline("group_max")(group_max)
    try:
        assert grpo(advantage={"baseline": "group_max"}).grpo.advantage.baseline == "group_max"
        adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.zeros(3, dtype=torch.long), baseline="group_max")
        assert adv.tolist() == [0.0, -1.0, -0.5]
    finally:
        BASELINES.unregister("group_max")


def test_an_unknown_value_is_refused_naming_the_registered_choices(abs_estimator):
    with pytest.raises(GymvError) as e:
        validate_config({"algorithm": "grpo", "grpo": {"loss": {"kl_estimator": "k4"}}})
    assert e.value.message == "`grpo.loss.kl_estimator`: 'k4' is not one of 'abs', 'k1', 'k2', 'k3'"
    assert e.value.fix == "use one of 'abs', 'k1', 'k2', 'k3'"
