"""GRPO advantages (leave-one-out and group-mean baselines) and MOPD per-token advantages, checked against
numbers worked out by hand."""

import math

import pytest
import torch

from gymv.algorithms.advantages import group_ids_for, grpo_advantages, mopd_advantages
from gymv.errors import GymvError

SQRT2 = math.sqrt(2.0)
SQRT3 = math.sqrt(3.0)


def adv(rewards, groups=None, valid=None, **kw):
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.zeros(len(rewards), dtype=torch.long) if groups is None else torch.tensor(groups)
    v = None if valid is None else torch.tensor(valid)
    return grpo_advantages(r, g, v, **kw).tolist()


def test_leave_one_out_baseline_is_the_mean_of_the_other_rewards():
    # sample 0: others (0,0,1) -> baseline 1/3; sample 1: others (1,0,1) -> baseline 2/3
    assert adv([1, 0, 0, 1], normalize_std=False) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)


def test_leave_one_out_divides_by_the_unbiased_std_of_the_other_rewards_by_default():
    # others of sample 0 are (0,0,1): b = 1/3, squared deviations sum to 2/3; over k - 1 = 2: std = sqrt(1/3),
    # so A = (2/3) / sqrt(1/3) = 2/sqrt(3) (NeMo RL's 1.155)
    assert adv([1, 0, 0, 1]) == pytest.approx([2 / SQRT3, -2 / SQRT3, -2 / SQRT3, 2 / SQRT3], rel=1e-5)


def test_the_population_std_divides_by_the_number_of_other_rewards():
    # the same deviations over k = 3: std = sqrt(2)/3, so A = (2/3) / (sqrt(2)/3) = sqrt(2)
    assert adv([1, 0, 0, 1], std="population") == pytest.approx([SQRT2, -SQRT2, -SQRT2, SQRT2], rel=1e-5)


def test_zero_leave_one_out_std_leaves_the_advantage_undivided():
    # sample 0: others (0,0) have std 0 -> A = 1 - 0 = 1; sample 1: others (1,0): b = .5, deviations sum to .5;
    # unbiased std sqrt(.5) -> A = -.5/sqrt(.5) = -sqrt(.5); population std .5 -> A = -1
    h = math.sqrt(0.5)
    assert adv([1, 0, 0]) == pytest.approx([1.0, -h, -h], rel=1e-5)
    assert adv([1, 0, 0], std="population") == pytest.approx([1.0, -1.0, -1.0], rel=1e-5)


def test_one_other_reward_has_no_unbiased_std_so_the_advantage_is_undivided():
    # G = 2, leave-one-out: k = 1, the unbiased std is undefined and taken as 0
    assert adv([1, 0]) == pytest.approx([1.0, -1.0])


def test_equal_rewards_that_binary_cannot_hold_exactly_count_as_no_spread():
    # polygon-naming scores thirds: seven others at 1/3 have no spread, so the lone 0 gets -1/3, not -3e5
    r = torch.tensor([1 / 3] * 7 + [0.0], dtype=torch.float64)
    a = grpo_advantages(r, torch.zeros(8, dtype=torch.long)).tolist()
    assert a[7] == pytest.approx(-1 / 3, rel=1e-9)
    assert max(abs(x) for x in a) < 10


def test_group_mean_baseline_includes_the_sample_itself():
    # mean .5, deviations sum to 1 over k = 4: unbiased std sqrt(1/3) -> A = +-0.5 * sqrt(3); population .5 -> +-1
    h = 0.5 * SQRT3
    assert adv([1, 0, 0, 1], baseline="mean") == pytest.approx([h, -h, -h, h], rel=1e-5)
    assert adv([1, 0, 0, 1], baseline="mean", std="population") == pytest.approx([1, -1, -1, 1], rel=1e-5)


def test_equal_rewards_give_zero_advantage():
    assert adv([1, 1, 1, 1]) == [0.0, 0.0, 0.0, 0.0]


def test_single_generation_per_prompt_gives_zero_advantage():
    assert adv([1.0, 0.0, 0.5], groups=[0, 1, 2]) == [0.0, 0.0, 0.0]
    assert adv([1.0, 0.0, 0.5], groups=[0, 1, 2], baseline="mean") == [0.0, 0.0, 0.0]


def test_excluded_samples_get_zero_and_stay_out_of_the_baseline():
    # the invalid reward 5 (or NaN) must not enter the others' baselines: result equals rewards (1,0,0)
    want = adv([1, 0, 0])
    assert adv([1, 0, 5, 0], valid=[True, True, False, True]) == pytest.approx([want[0], want[1], 0, want[2]])
    assert adv([1, 0, float("nan"), 0], valid=[True, True, False, True]) == pytest.approx([want[0], want[1], 0, want[2]])


def test_a_group_with_one_valid_sample_gives_zero():
    assert adv([1, 0], valid=[True, False]) == [0.0, 0.0]


def test_groups_need_not_be_contiguous():
    assert adv([1, 3, 0, 3], groups=[0, 1, 0, 1]) == pytest.approx([1, 0, -1, 0], abs=1e-6)


def test_group_ids_for_contiguous_layout():
    assert group_ids_for(2, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_non_finite_valid_reward_is_an_error():
    with pytest.raises(GymvError, match="non-finite reward"):
        adv([1.0, float("inf")])


def test_mopd_advantage_is_the_detached_teacher_student_gap():
    student = torch.log(torch.tensor([[0.25, 0.5]])).requires_grad_()
    teacher = torch.log(torch.tensor([[0.5, 0.5]]))
    a = mopd_advantages(teacher, student, torch.tensor([[True, False]]))
    assert a.tolist()[0] == pytest.approx([math.log(2.0), 0.0])
    assert not a.requires_grad
