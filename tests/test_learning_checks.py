"""The learning judgement the end-to-end learning tests share (tests/learning.py), on made-up series."""

from __future__ import annotations

import random

import pytest

from learning import assert_learns, learning_failures

RISING = [0.2 + 0.006 * i for i in range(100)]  # 0.2 -> 0.8


def test_a_rising_reward_and_validation_pass():
    assert learning_failures(RISING, [0.5, 0.7, 0.8, 0.9], window=20) == []


def test_a_flat_noisy_series_fails_it():
    rng = random.Random(0)
    noise = [0.5 + rng.uniform(-0.2, 0.2) for _ in range(100)]
    failures = learning_failures(noise, [0.5, 0.45, 0.55, 0.5], window=20)
    assert any("train reward" in f for f in failures) and any("validation" in f for f in failures)


def test_a_last_validation_below_the_start_fails_even_after_a_lucky_peak():
    failures = learning_failures(RISING, [0.5, 0.95, 0.9, 0.45], window=20)
    assert failures == ["the last validation 0.450 is below the start 0.500"]


def test_too_short_a_series_is_no_evidence():
    assert learning_failures(RISING[:30], [0.5], window=20) == [
        "30 train rewards, fewer than two windows of 20", "1 validations: need the start and validations from the 2th on"]


def test_the_later_mean_may_leave_out_the_first_validations():
    validations = [0.5, 0.4, 0.7, 0.8]  # an early dip, then well above the start
    assert learning_failures(RISING, validations, window=20, later_from=2) == []
    assert learning_failures(RISING, [0.5, 0.9, 0.5, 0.55], window=20, later_from=2) != []


def test_assert_learns_names_what_failed():
    with pytest.raises(AssertionError, match="train reward 0.500 -> 0.500"):
        assert_learns([0.5] * 40, [0.5, 0.9], window=20)


def test_the_validations_may_have_a_margin_of_their_own():
    validations = [0.555, 0.484, 0.523, 0.703, 0.734]  # a NeMo Gym agents run: mean of the last three 0.654
    assert learning_failures(RISING, validations, window=20, later_from=2) != []
    assert learning_failures(RISING, validations, window=20, later_from=2, val_margin=0.08) == []
    assert learning_failures(RISING, [0.5, 0.5, 0.55, 0.55], window=20, later_from=2, val_margin=0.08) != []
