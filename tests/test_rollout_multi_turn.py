"""Multi-turn rollouts: token-sequence extension, per-turn images, tool errors, crashes and truncation.

A scripted policy (real logprobs) drives PictureEnv (both in rollout_helpers): its tool `look` returns
an image, a scripted follow-up after the second turn shows another image, and its tool `explode` crashes.
circle-click with max_turns 2 runs the same way with a real built-in environment.
"""

from __future__ import annotations

import json

import pytest

from gymv.backends.generation import SamplingParams
from gymv.envs.protocol import RowError
from gymv.rollout import run_rollouts, to_rollout_record
from gymv.runs.rollout_log import model_calls, validate_rollout
from rollout_helpers import (BLUE, GREEN, RED, PictureEnv, ScriptedBackend, picture_row, sample_of, script,
                             tiny_rows, turn_of)
from tiny_models import shared_policy


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def run(policy, backend, env, rows, *, group_size=2, max_turns=3, max_seq_len=1024, **kw):
    return run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, env, rows,
                        group_size=group_size, params=SamplingParams(max_new_tokens=48, temperature=1.0),
                        max_turns=max_turns, max_rollout_tokens=256, max_seq_len=max_seq_len, seed=3, **kw)


@pytest.fixture(scope="module")
def pictures(policy):
    backend = ScriptedBackend(policy, script)
    return backend, run(policy, backend, PictureEnv(), [(0, picture_row())])


def test_each_turn_extends_the_previous_prompt_and_its_sampled_tokens(pictures):
    backend, trajs = pictures
    assert len(backend.calls) == 3  # one generate call per turn for the whole batch
    for t in trajs:
        history = backend.history(f"row 0 sample {t.sample_index}")
        assert len(history) == t.turns == 3
        for (req, out), (nxt, _) in zip(history, history[1:]):
            n = len(req.prompt_token_ids)
            assert nxt.prompt_token_ids[:n] == req.prompt_token_ids
            assert nxt.prompt_token_ids[n:n + len(out.token_ids)] == out.token_ids
        last_req, last_out = history[-1]
        assert t.token_ids == last_req.prompt_token_ids + last_out.token_ids


def test_mask_is_one_exactly_on_the_sampled_tokens_of_every_turn(pictures):
    backend, trajs = pictures
    for t in trajs:
        history = backend.history(f"row 0 sample {t.sample_index}")
        expected = [0] * len(t.token_ids)
        for call, (_, out) in zip(t.model_calls, history):
            s, e = call["generation_start"], call["generation_end"]
            assert t.token_ids[s:e] == out.token_ids and t.logprobs[s:e] == out.logprobs
            expected[s:e] = [1] * (e - s)
        assert t.loss_mask == expected
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)


def test_images_are_attributed_to_the_turn_that_introduced_them(pictures, policy):
    _, trajs = pictures
    for t in trajs:
        assert t.image_turns == [0, 1, 2]
        assert [im.getpixel((0, 0)) for im in t.images] == [GREEN, RED, BLUE]
        spans = [k for k, (a, b) in enumerate(zip([None] + t.token_ids, t.token_ids))
                 if b == policy.adapter.image_token_id and a != b]
        calls = t.model_calls
        assert spans[0] < calls[0]["generation_start"]
        assert calls[0]["generation_end"] <= spans[1] < calls[1]["generation_start"]
        assert calls[1]["generation_end"] <= spans[2] < calls[2]["generation_start"]
        policy.adapter.check(t.token_ids, t.images, where="test")


def test_only_environment_text_is_inserted_between_turns(pictures, policy):
    _, trajs = pictures
    t = trajs[0]
    a, b = t.model_calls[0]["generation_end"], t.model_calls[1]["generation_start"]
    image = "<image>" * policy.adapter.tokens_per_image(t.images[1])
    assert policy.tokenizer.decode(t.token_ids[a:b]) == (
        f"<|im_start|>tool\n<tool_response>here{image}</tool_response><|im_end|><|im_start|>assistant\n")


def test_transcript_holds_calls_results_follow_ups_and_the_reward(pictures):
    _, trajs = pictures
    for t in trajs:
        assert [i["type"] for i in t.output] == ["function_call", "function_call_output", "message", "message",
                                                 "message"]
        assert t.output[1]["output"][0] == {"type": "input_text", "text": "here"}
        assert t.output[3]["role"] == "user"
        assert t.reward == 1.0 and t.finish_reason == "stop" and not t.truncated and t.error is None


def test_a_tool_image_shared_by_the_group_is_decoded_once(policy):
    stats = {}
    trajs = run(policy, ScriptedBackend(policy, script), PictureEnv(), [(0, picture_row())], group_size=2,
                stats=stats)
    assert stats["image_decodes"] == 3  # prompt, tool result, follow-up: each once for both episodes
    for k in range(3):
        assert all(t.images[k] is trajs[0].images[k] for t in trajs)


def test_malformed_tool_call_becomes_a_tool_error_the_model_reads(policy):
    bad = '<tool_call>{"name": "look", "arguments": {</tool_call><|im_end|>'
    backend = ScriptedBackend(policy, lambda w: bad if turn_of(w) == 0 else "ok<|im_end|>")
    (t,) = run(policy, backend, PictureEnv(), [(0, picture_row())], group_size=1, max_turns=2)
    call, result = t.output[0], t.output[1]
    assert call["type"] == "function_call" and call["name"] == "look"
    assert result["type"] == "function_call_output" and "not valid JSON" in json.loads(result["output"])["error"]
    a, b = t.model_calls[0]["generation_end"], t.model_calls[1]["generation_start"]
    assert "not valid JSON" in policy.tokenizer.decode(t.token_ids[a:b])
    assert t.error is None and t.turns == 2


def test_unknown_tool_is_answered_with_an_error_result(policy):
    backend = ScriptedBackend(policy, lambda w: '<tool_call>{"name": "fly", "arguments": {}}</tool_call><|im_end|>'
                              if turn_of(w) == 0 else "ok<|im_end|>")
    (t,) = run(policy, backend, PictureEnv(), [(0, picture_row())], group_size=1, max_turns=2)
    assert "unknown tool 'fly'" in json.loads(t.output[1]["output"])["error"] and t.error is None


def test_a_crashing_tool_marks_only_its_own_trajectory(policy):
    crash = '<tool_call>{"name": "explode", "arguments": {}}</tool_call><|im_end|>'
    backend = ScriptedBackend(policy, lambda w: crash if sample_of(w) == 0 and turn_of(w) == 0 else script(w))
    crashed, fine = run(policy, backend, PictureEnv(), [(0, picture_row())])
    assert "tool backend went away" in crashed.error and crashed.finish_reason == "error"
    assert crashed.turns == 1 and crashed.reward == 0.0
    assert fine.error is None and fine.turns == 3 and fine.reward == 1.0
    validate_rollout(to_rollout_record(crashed), where="crashed")


def test_turn_that_does_not_fit_ends_at_the_turn_boundary(policy, pictures):
    _, (full, _) = pictures
    after_first_turn = full.model_calls[0]["generation_end"]
    (t,) = run(policy, ScriptedBackend(policy, script), PictureEnv(), [(0, picture_row())], group_size=1,
               max_seq_len=after_first_turn + 30)  # the tool's image alone needs 64 tokens
    assert t.truncated and t.finish_reason == "length" and t.turns == 1
    assert t.token_ids == full.token_ids[:after_first_turn]
    assert len(t.images) == 1 and t.image_turns == [0]
    policy.adapter.check(t.token_ids, t.images, where="test")


def test_a_prompt_over_max_seq_len_fails_its_episode_naming_the_key_to_raise(policy):
    (t,) = run(policy, ScriptedBackend(policy, script), PictureEnv(), [(0, picture_row())], group_size=1,
               max_seq_len=16)  # the picture alone is 64 tokens
    assert t.error.startswith("the prompt has ") and "max_seq_len 16 (raise model.max_seq_len above it)" in t.error


def test_max_images_ends_the_episode_before_the_extra_image(policy):
    (t,) = run(policy, ScriptedBackend(policy, script), PictureEnv(), [(0, picture_row())], group_size=1,
               max_images=2)
    assert t.turns == 2 and t.image_turns == [0, 1] and t.truncated and t.finish_reason == "max_images"


def test_turn_cap_ends_an_episode_the_environment_would_continue(policy):
    (t,) = run(policy, ScriptedBackend(policy, script), PictureEnv(), [(0, picture_row())], group_size=1,
               max_turns=1)
    assert t.turns == 1 and t.finish_reason == "max_turns" and not t.truncated
    assert t.token_ids[-1] == policy.tokenizer.eos_token_id  # nothing appended after the last sample


def test_turn_stopped_without_end_of_turn_token_is_closed_by_the_template(policy):
    backend = ScriptedBackend(policy, lambda w: '<tool_call>{"name": "look", "arguments": {}}</tool_call>'
                              if turn_of(w) == 0 else "ok<|im_end|>")
    (t,) = run(policy, backend, PictureEnv(), [(0, picture_row())], group_size=1, max_turns=2)
    a = t.model_calls[0]["generation_end"]
    assert t.loss_mask[a] == 0 and t.token_ids[a] == policy.tokenizer.eos_token_id
    assert policy.tokenizer.decode(t.token_ids[a + 1:a + 3]) == "<|im_start|>tool"


def test_circle_click_two_turns_rewards_the_first_click_and_logs_each_call(policy):
    env, rows = tiny_rows("circle-click", 1, max_turns=2)
    target = env.target_circle(rows[0][1])
    click = f'<tool_call>{{"name": "click", "arguments": {{"x": {target["x"]}, "y": {target["y"]}}}}}</tool_call><|im_end|>'
    backend = ScriptedBackend(policy, lambda w: click if turn_of(w) == 0 else "Clicked.<|im_end|>")
    (t,) = run(policy, backend, env, rows, group_size=1, max_turns=2)
    assert [i["type"] for i in t.output] == ["function_call", "function_call_output", "message"]
    assert t.reward == 1.0 and t.extras["hit"] is True and t.turns == 2
    record = to_rollout_record(t)
    validate_rollout(record, where="circle-click")
    calls = model_calls(record)
    assert [i for i, item in enumerate(record["response"]["output"]) if "generation_token_ids" in item] == [0, 2]
    for call, span in zip(calls, t.model_calls):
        s, e = span["generation_start"], span["generation_end"]
        assert call["prompt_token_ids"] == t.token_ids[:s]
        assert call["generation_token_ids"] == t.token_ids[s:e]
        assert call["generation_log_probs"] == t.logprobs[s:e]
    assert record["_ng_task_index"] == 0 and record["_ng_rollout_index"] == 0 and record["reward"] == 1.0


def test_circle_click_default_max_turns_ends_after_the_click(policy):
    env, rows = tiny_rows("circle-click", 1)
    backend = ScriptedBackend(policy, lambda w: '<tool_call>{"name": "click", "arguments": {"x": 0, "y": 0}}</tool_call><|im_end|>')
    (t,) = run(policy, backend, env, rows, group_size=1, max_turns=4)
    assert t.turns == 1 and t.finish_reason == "stop" and t.failure_reason == "miss"


class VerifierDown(PictureEnv):
    def score_output(self, row, output):
        raise ConnectionError("verifier refused the connection")


class BadAnswerField(PictureEnv):
    def score_output(self, row, output):
        raise RowError("field 'answer' must be a string")


class WontStart(PictureEnv):
    def start(self, row, *, where=None):
        raise ConnectionError("env server refused the connection")


def test_scoring_that_crashes_marks_the_trajectory_error(policy):
    (t,) = run(policy, ScriptedBackend(policy, script), VerifierDown(), [(0, picture_row())], group_size=1,
               max_turns=1)
    assert "verifier refused" in t.error and t.finish_reason == "error" and t.turns == 1


def test_scoring_that_blames_the_data_raises_naming_the_row(policy):
    with pytest.raises(RowError, match=r"eval\.jsonl line 3 sample 0: field 'answer' must be a string"):
        run(policy, ScriptedBackend(policy, script), BadAnswerField(), [(2, picture_row())], max_turns=1,
            source="eval.jsonl")


def test_environment_that_fails_to_start_marks_its_episodes_and_spares_the_rest(policy):
    def env_for(row):
        return WontStart() if row.get("broken") else PictureEnv()

    backend = ScriptedBackend(policy, script)
    trajs = run(policy, backend, env_for, [(0, {**picture_row(), "broken": True}), (1, picture_row())], max_turns=1)
    assert ["refused" in (t.error or "") for t in trajs] == [True, True, False, False]
    assert trajs[0].token_ids == [] and len(backend.calls[0][0]) == 2
