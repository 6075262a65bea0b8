"""`grpo.advantage.clip_low`/`clip_high` (NeMo RL's advantage_clip_low/high): the advantages GRPO trains with
are bounded after normalisation, their statistics are the bounded values', and the share bounded is logged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gymv.config import load_recipe
from gymv.config.schema import Advantage
from gymv.errors import GymvError
from gymv.train.stats import group_advantages
from conftest import REPO


def episodes(*rewards):
    return [SimpleNamespace(error=None, reward=r, loss_mask=[1, 1]) for r in rewards]


def test_without_bounds_advantages_are_left_as_normalised_and_no_share_is_logged():
    adv, stats = group_advantages(episodes(0.0, 0.0, 0.0, 1.0), 4, Advantage(baseline="mean", normalize_std=False))
    assert adv == pytest.approx([-0.25, -0.25, -0.25, 0.75])
    assert "train/advantage_clipped_fraction" not in stats


def test_bounds_clamp_the_normalised_advantages_and_log_the_share_they_moved():
    cfg = Advantage(baseline="mean", normalize_std=False, clip_low=-0.2, clip_high=0.5)
    adv, stats = group_advantages(episodes(0.0, 0.0, 0.0, 1.0), 4, cfg)
    assert adv == pytest.approx([-0.2, -0.2, -0.2, 0.5])
    assert stats["train/advantage_clipped_fraction"] == 1.0 and stats["train/advantage_max"] == pytest.approx(0.5)


def test_one_sided_bound_leaves_the_other_side_free():
    adv, _ = group_advantages(episodes(0.0, 0.0, 0.0, 1.0), 4, Advantage(baseline="mean", normalize_std=False,
                                                                         clip_high=0.5))
    assert adv == pytest.approx([-0.25, -0.25, -0.25, 0.5])


def test_the_recipe_keys_reach_the_advantages_and_an_inverted_range_is_refused():
    grpo = load_recipe(REPO / "recipes" / "grpo.yaml", ["grpo.advantage.clip_low=-1", "grpo.advantage.clip_high=1"])
    assert grpo.validated.grpo.advantage.bounds() == (-1.0, 1.0)
    with pytest.raises(GymvError, match="clip_low 1 must be below clip_high -1"):
        load_recipe(REPO / "recipes" / "grpo.yaml", ["grpo.advantage.clip_low=1", "grpo.advantage.clip_high=-1"]).validated
