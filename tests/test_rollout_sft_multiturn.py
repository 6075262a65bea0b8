"""Multi-turn SFT samples: every gold turn under the mask, the environment's turns between them, and the very
sequence a rollout produces when the policy says the gold turns (SFT and RL train on the same tokens).

The rollout side is a ScriptedBackend (real logprobs) replying `reply_text(gold turn k)` at turn k: the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form the loop's parser reads, then `<|im_end|>`.
"""

from __future__ import annotations

import pytest

from gymv.backends.generation import SamplingParams
from gymv.errors import GymvError
from gymv.rollout import build_sft_sample, run_rollouts, to_rollout_record
from gymv.runs.rollout_log import validate_rollout
from envs_scripts import gold_script, reply_text
from rollout_helpers import ScriptedBackend, tiny_rows
from tiny_models import shared_policy

ENVS = ["polygon-naming", "doorkey", "scripted"]
# image_turns of row 0 of each tiny preset: polygon-naming shows two pictures, the tool the third;
# doorkey answers every move with a picture; scripted's follow-ups are text.
IMAGE_TURNS = {"polygon-naming": [0, 0, 1], "doorkey": [0, 1, 2, 3, 4], "scripted": [0]}


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def sft(policy, env, row, max_seq_len=4096, **kw):
    return build_sft_sample(env, row, policy.adapter, policy.tokenizer, policy.chat_template,
                            max_seq_len=max_seq_len, **kw)


def scripted_rollout(policy, env, rows, **kw):
    (t,) = run_rollouts(ScriptedBackend(policy, gold_script(env, dict(rows))), policy.adapter, policy.tokenizer,
                        policy.chat_template, env, rows, group_size=1, params=SamplingParams(max_new_tokens=96),
                        max_turns=env.max_turns, max_rollout_tokens=4096, max_seq_len=4096, seed=0, **kw)
    return t


@pytest.fixture(scope="module", params=ENVS)
def case(request, policy):
    env, rows = tiny_rows(request.param, 1)
    row = rows[0][1]
    return request.param, env, row, sft(policy, env, row), scripted_rollout(policy, env, rows)


def test_gold_episode_scores_full_reward_over_every_gold_turn(case):
    name, env, row, t, _ = case
    assert t.reward == 1.0 and t.error is None and t.failure_reason is None
    assert t.turns == len(env.gold_turns(row)) > 1 and t.finish_reason == "stop"


def test_mask_covers_exactly_the_assistant_turns(case, policy):
    _, env, row, t, _ = case
    expected = [0] * len(t.token_ids)
    for call, gold in zip(t.model_calls, env.gold_turns(row), strict=True):
        s, e = call["generation_start"], call["generation_end"]
        assert policy.tokenizer.decode(t.token_ids[s:e]) == reply_text(gold)
        expected[s:e] = [1] * (e - s)
    assert t.loss_mask == expected and t.logprobs == [0.0] * len(t.token_ids)


def test_sample_is_token_for_token_the_rollout_of_a_policy_saying_the_gold_turns(case):
    _, _, _, t, rollout = case
    assert t.token_ids == rollout.token_ids
    assert t.loss_mask == rollout.loss_mask
    assert [(c["turn"], c["generation_start"], c["generation_end"]) for c in t.model_calls] == [
        (c["turn"], c["generation_start"], c["generation_end"]) for c in rollout.model_calls]
    assert t.output == rollout.output and t.reward == rollout.reward == 1.0


def test_images_and_their_turns_match_the_rollout(case, policy):
    name, _, _, t, rollout = case
    assert t.image_turns == rollout.image_turns == IMAGE_TURNS[name]
    assert t.image_keys == rollout.image_keys
    policy.adapter.check(t.token_ids, t.images, where=name)


def test_environment_turns_between_gold_turns_are_masked_out(case, policy):
    name, _, _, t, _ = case
    a, b = t.model_calls[0]["generation_end"], t.model_calls[1]["generation_start"]
    between = policy.tokenizer.decode(t.token_ids[a:b])
    assert set(t.loss_mask[a:b]) == {0} and between.endswith("<|im_start|>assistant\n")
    assert between.startswith("<|im_start|>user\n" if name == "scripted" else "<|im_start|>tool\n<tool_response>")


def test_sft_sample_of_a_gold_episode_is_a_valid_rollout_record(case):
    _, _, _, t, _ = case
    record = to_rollout_record(t)
    validate_rollout(record, where="sft")
    assert record["_gymv"]["image_turns"] == t.image_turns and record["_gymv"]["turns"] == t.turns


def test_multi_turn_sample_over_max_seq_len_is_an_error_not_a_cut(policy):
    env, [(_, row)] = tiny_rows("doorkey", 1)
    n = len(sft(policy, env, row).token_ids)
    t = sft(policy, env, row, max_seq_len=n - 1)
    assert "max_seq_len" in t.error and len(t.token_ids) == n


def test_an_environment_that_ends_before_the_gold_episode_scores_what_was_reached(policy):
    env, [(_, row)] = tiny_rows("doorkey", 1, max_turns=2)  # the gold path needs 5 moves
    t = sft(policy, env, row)
    assert t.turns == 2 and t.reward == 0.0 and t.failure_reason == "goal_not_reached"


# A template variable the tiny template lacks: a line of guidance before the conversation.
HINTED = ("{%- if hint is defined -%}<|im_start|>system{{ '\\n' }}{{ hint }}<|im_end|>{%- endif -%}")


def test_chat_template_kwargs_render_the_same_for_generation_and_training(policy):
    env, rows = tiny_rows("polygon-naming", 1)
    template, kwargs = HINTED + policy.chat_template, {"chat_template_kwargs": {"hint": "Be brief."}}
    t = build_sft_sample(env, rows[0][1], policy.adapter, policy.tokenizer, template, max_seq_len=4096, **kwargs)
    (r,) = run_rollouts(ScriptedBackend(policy, gold_script(env, dict(rows))), policy.adapter, policy.tokenizer,
                        template, env, rows, group_size=1, params=SamplingParams(max_new_tokens=96), max_turns=3,
                        max_rollout_tokens=4096, max_seq_len=4096, seed=0, **kwargs)
    plain = sft(policy, env, rows[0][1])
    assert t.token_ids == r.token_ids and t.loss_mask == r.loss_mask and t.reward == 1.0
    assert policy.tokenizer.decode(t.token_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert len(t.token_ids) > len(plain.token_ids)


def test_chat_template_kwargs_may_not_override_what_the_loop_sets(policy):
    env, [(_, row)] = tiny_rows("scripted", 1)
    with pytest.raises(GymvError, match="add_generation_prompt"):
        sft(policy, env, row, chat_template_kwargs={"add_generation_prompt": False})


def test_sft_sample_through_a_remote_environment_equals_the_in_process_one(policy):
    from gymv.envs import get_env, make_env
    from gymv.envs.server import EnvServer

    local = get_env("polygon-naming")
    _, [(_, row)] = tiny_rows("polygon-naming", 1)
    with EnvServer(local) as srv:
        remote = make_env({"name": "polygon-naming", "url": srv.url, "max_turns": 3})
        over_http = sft(policy, remote, row)
    in_process = sft(policy, local, row)
    assert over_http.error is None and over_http.reward == in_process.reward == 1.0
    assert over_http.token_ids == in_process.token_ids and over_http.loss_mask == in_process.loss_mask
    assert over_http.image_turns == in_process.image_turns == [0, 0, 1]
