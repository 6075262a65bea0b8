"""The learning-rate schedule: warm-up, then constant or a decay that ends at min_lr_ratio x lr."""

from __future__ import annotations

import pytest

from gymv.backends.training.lr_schedule import lr_factor
from gymv.config.schema import MODELS


def test_constant_keeps_the_rate_after_the_warm_up():
    assert [lr_factor(k, warmup_steps=4) for k in (1, 2, 4, 100)] == [0.25, 0.5, 1.0, 1.0]


def test_cosine_starts_at_the_full_rate_and_ends_at_the_floor():
    f = [lr_factor(k, warmup_steps=10, total_steps=111, schedule="cosine", min_ratio=0.1) for k in (10, 11, 61, 111)]
    assert f == pytest.approx([1.0, 1.0, 0.55, 0.1])


def test_linear_decays_evenly_to_zero():
    f = [lr_factor(k, total_steps=101, schedule="linear") for k in (1, 26, 51, 101, 150)]
    assert f == pytest.approx([1.0, 0.75, 0.5, 0.0, 0.0])


def test_a_decay_multiplies_the_warm_up_ramp():
    assert lr_factor(5, warmup_steps=10, total_steps=100, schedule="cosine") == pytest.approx(0.5)


def test_optimizer_steps_count_minibatches_of_every_step():
    cfg = MODELS["grpo"].model_validate({"algorithm": "grpo", "grpo": {"max_steps": 30, "prompts_per_step": 4,
                                         "generations_per_prompt": 8}, "training": {"global_batch_size": 16}})
    assert cfg.optimizer_steps == 60


def test_an_unknown_schedule_is_refused_by_the_schema():
    with pytest.raises(Exception, match="lr_schedule"):
        MODELS["grpo"].model_validate({"algorithm": "grpo", "training": {"lr_schedule": "step"}})


def test_a_warm_up_may_start_above_zero_as_megatrons_lr_warmup_init_does():
    f = [lr_factor(k, warmup_steps=10, warmup_init_ratio=0.01) for k in (1, 5, 10, 11)]
    assert f == pytest.approx([0.01 + 0.99 * 0.1, 0.01 + 0.99 * 0.5, 1.0, 1.0])
    assert lr_factor(3, warmup_init_ratio=0.5) == 1.0  # no warm-up, nothing to start
