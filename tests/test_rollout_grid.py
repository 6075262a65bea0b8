"""The loop with a grid processor (tiny Qwen2-VL): image spans depend on each image's size."""

from __future__ import annotations

import pytest

from gymv.backends.generation import SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.rollout import run_rollouts
from rollout_helpers import PictureEnv, ScriptedBackend, picture_row, script, tiny_rows
from tiny_models import shared_policy

pytestmark = pytest.mark.slow  # loads a second tiny model


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-qwen2vl")


def test_multi_turn_images_of_different_sizes_get_their_own_spans(policy):
    (t,) = run_rollouts(ScriptedBackend(policy, script), policy.adapter, policy.tokenizer, policy.chat_template,
                        PictureEnv(), [(0, picture_row())], group_size=1, params=SamplingParams(max_new_tokens=48),
                        max_turns=3, max_rollout_tokens=256, max_seq_len=1024, seed=0)
    assert t.image_turns == [0, 1, 2] and t.reward == 1.0
    need = [policy.adapter.tokens_per_image(im) for im in t.images]
    assert len(set(need)) > 1  # the three images really need different span lengths
    policy.adapter.check(t.token_ids, t.images, where="test")


def test_single_turn_sampling_with_the_grid_model(policy):
    env, rows = tiny_rows("circle-count", 1)
    trajs = run_rollouts(HFGenerationBackend.from_policy(policy, seed=0), policy.adapter, policy.tokenizer,
                         policy.chat_template, env, rows, group_size=2, params=SamplingParams(max_new_tokens=8),
                         max_turns=1, max_rollout_tokens=64, max_seq_len=512, seed=0)
    for t in trajs:
        policy.adapter.check(t.token_ids, t.images, where="test")
        assert t.error is None and sum(t.loss_mask) == len(t.token_ids) - t.prompt_length > 0
