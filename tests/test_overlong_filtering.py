"""`grpo.overlong_filtering` / `mopd.overlong_filtering`, NeMo RL's key and semantics: an episode a token budget cut
before it finished leaves the loss and its counts, while its reward stays in its group's baseline."""

from __future__ import annotations

import math

import pytest

from gymv.config import load_recipe
from gymv.rollout.types import Trajectory
from gymv.timing import PhaseTimer
from gymv.train.grpo import grpo_batch
from gymv.train.stats import overlong, trained
from conftest import REPO

MAX_SEQ_LEN = 64


def episode(reward: float = 0.0, finish: str = "stop", length: int = 6, sample: int = 0) -> Trajectory:
    return Trajectory(row={}, task_index=0, sample_index=sample, agent_name="a", token_ids=list(range(10, 10 + length)),
                      loss_mask=[0, 0] + [1] * (length - 2), logprobs=[0.0, 0.0] + [-0.5] * (length - 2),
                      reward=reward, finish_reason=finish, truncated=finish in ("length", "max_images"))


def grpo_section(filtering: bool):
    return load_recipe(REPO / "recipes" / "grpo.yaml", ["grpo.generations_per_prompt=4",
                                                        f"grpo.overlong_filtering={str(filtering).lower()}"]).validated.grpo


def test_an_episode_a_token_budget_cut_is_overlong_and_one_that_finished_is_not():
    assert overlong(episode(finish="length"), MAX_SEQ_LEN)
    assert not overlong(episode(finish="stop"), MAX_SEQ_LEN)
    assert not overlong(episode(finish="max_turns"), MAX_SEQ_LEN)
    assert not overlong(episode(finish="max_images"), MAX_SEQ_LEN)  # an image budget, not a token one


def test_an_agents_episode_that_fills_max_seq_len_is_overlong():
    """NeMo RL's rule for NeMo Gym rollouts, whose finish reasons gymv does not see."""
    assert overlong(episode(finish="stop", length=MAX_SEQ_LEN), MAX_SEQ_LEN)


def test_a_filtered_episode_leaves_the_samples_but_its_reward_stays_in_the_baseline():
    """Rewards [1, 0, 0, 1] with the last episode cut: leave-one-out, unbiased std (docs/algorithms.md §2). With
    the cut reward in the baseline, sample 0 sees (0, 0, 1): A = (2/3) / sqrt(1/3); recomputed without it, it
    would see (0, 0) and get A = 1."""
    eps = [episode(1.0, sample=0), episode(0.0, sample=1), episode(0.0, sample=2), episode(1.0, "length", sample=3)]
    batch = grpo_batch(grpo_section(True), MAX_SEQ_LEN)(eps, PhaseTimer())
    a = (2 / 3) * math.sqrt(3)
    assert [float(s["advantages"]) for s in batch.samples] == pytest.approx([a, -a, -a], rel=1e-5)
    assert batch.rewards == [1.0, 0.0, 0.0]
    assert batch.metrics["train/num_overlong_filtered"] == 1.0
    assert batch.metrics["train/reward_mean"] == 0.5  # the rollout statistics still see every episode


def test_without_overlong_filtering_a_cut_episode_trains_and_nothing_is_counted():
    eps = [episode(1.0, sample=0), episode(0.0, sample=1), episode(0.0, sample=2), episode(1.0, "length", sample=3)]
    batch = grpo_batch(grpo_section(False), MAX_SEQ_LEN)(eps, PhaseTimer())
    assert len(batch.samples) == 4 and "train/num_overlong_filtered" not in batch.metrics


def test_mopd_filters_the_same_episodes_and_counts_them():
    mopd = load_recipe(REPO / "recipes" / "mopd.yaml", ["mopd.overlong_filtering=true"]).validated.mopd
    no_tokens = episode(finish="length", length=2)  # nothing generated: it never trains, filtered or not
    keep, metrics = trained([episode(finish="length"), episode(), no_tokens], mopd.overlong_filtering, MAX_SEQ_LEN)
    assert keep == [False, True, False] and metrics == {"train/num_overlong_filtered": 1.0}
