"""SFT samples: the prompt as a rollout sees it, then the environment's gold turn under the loss mask."""

from __future__ import annotations

import pytest

from gymv.backends.generation import SamplingParams
from gymv.backends.generation.hf import HFGenerationBackend
from gymv.rollout import build_sft_sample, run_rollouts, to_rollout_record
from gymv.runs.rollout_log import validate_rollout
from rollout_helpers import tiny_rows
from tiny_models import shared_policy


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def sft(policy, env, row, max_seq_len=1024):
    return build_sft_sample(env, row, policy.adapter, policy.tokenizer, policy.chat_template,
                            max_seq_len=max_seq_len, task_index=4)


def masked_text(policy, t):
    return policy.tokenizer.decode([tok for tok, m in zip(t.token_ids, t.loss_mask) if m])


def test_mask_covers_exactly_the_gold_tool_call_and_its_end_of_turn(policy):
    env, [(_, row)] = tiny_rows("circle-click", 1)
    t = sft(policy, env, row)
    c = env.target_circle(row)
    assert masked_text(policy, t) == (
        f'<tool_call>{{"name": "click", "arguments": {{"x": {c["x"]}, "y": {c["y"]}}}}}</tool_call><|im_end|>')
    start = t.model_calls[0]["generation_start"]
    assert t.loss_mask == [0] * start + [1] * (len(t.token_ids) - start)
    assert t.logprobs == [0.0] * len(t.token_ids)
    assert t.reward == 1.0 and t.error is None and t.task_index == 4


def test_gold_answer_text_sample_earns_full_reward(policy):
    env, [(_, row)] = tiny_rows("circle-count", 1)
    t = sft(policy, env, row)
    assert masked_text(policy, t) == f"\\boxed{{{env.expected_count(row)}}}<|im_end|>"
    assert t.reward == 1.0 and t.image_turns == [0]


def test_sft_prompt_is_token_for_token_the_rollout_prompt(policy):
    env, rows = tiny_rows("circle-click", 1)
    (rollout,) = run_rollouts(HFGenerationBackend.from_policy(policy, seed=0), policy.adapter, policy.tokenizer,
                              policy.chat_template, env, rows, group_size=1, params=SamplingParams(max_new_tokens=2),
                              max_turns=1, max_rollout_tokens=8, max_seq_len=1024, seed=0)
    t = sft(policy, env, rows[0][1])
    n = rollout.prompt_length
    assert t.token_ids[:n] == rollout.token_ids[:n] and t.prompt_length == n


def test_sample_longer_than_max_seq_len_is_an_error_not_a_cut(policy):
    env, [(_, row)] = tiny_rows("circle-count", 1)
    n = len(sft(policy, env, row).token_ids)
    t = sft(policy, env, row, max_seq_len=n - 1)
    assert "max_seq_len" in t.error and len(t.token_ids) == n


def test_sft_sample_is_a_valid_rollout_record(policy):
    env, [(_, row)] = tiny_rows("circle-click", 1)
    record = to_rollout_record(sft(policy, env, row))
    validate_rollout(record, where="sft")
    assert record["response"]["output"][0]["generation_log_probs"] == [0.0] * len(
        record["response"]["output"][0]["generation_token_ids"])
