"""Rollout logs in NeMo Gym's rollout format, checked against NeMo Gym's own recorded rollouts."""

import json

import pytest

from gymv.errors import GymvError
from gymv.runs.rollout_log import (
    attach_model_call_tokens,
    make_rollout_record,
    model_calls,
    read_rollouts,
    rollout_files,
    rollout_path,
    write_rollouts,
)

ENVS = ["circle_count", "circle_click", "example_multi_turn_gymnasium"]


def real_rollouts(vectors, env):
    return [json.loads(line) for line in (vectors / "nemo_gym" / env / "example_rollouts.jsonl").read_text().splitlines() if line.strip()]


def two_call_record():
    row = {"responses_create_params": {"input": [{"role": "user", "content": "hi"}], "tools": []},
           "agent_ref": {"type": "responses_api_agents", "name": "demo"}}
    first = [{"type": "function_call", "name": "click", "arguments": "{}", "call_id": "c1"}]
    attach_model_call_tokens(first, [1, 2], [3, 4], [-0.5, -0.25])
    tool = [{"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    second = [{"type": "reasoning", "summary": []}, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    attach_model_call_tokens(second, [1, 2, 3, 4, 5], [6], [-0.1])
    return make_rollout_record(row, first + tool + second, 1.0, model="tiny", extras={"hit": True}, task_index=3, rollout_index=1)


@pytest.mark.parametrize("env", ENVS)
def test_records_have_the_top_level_shape_of_nemo_gym_rollouts(vectors, env):
    ours = two_call_record()
    theirs = real_rollouts(vectors, env)[0]
    for key in ("responses_create_params", "response", "reward", "_ng_task_index", "_ng_rollout_index"):
        assert key in theirs and key in ours
        assert type(ours[key]) is type(theirs[key])
    for key in ("id", "object", "output", "model", "created_at"):
        assert key in theirs["response"] and key in ours["response"]
    assert ours["response"]["object"] == theirs["response"]["object"] == "response"


def test_token_fields_sit_on_the_last_item_of_each_model_call():
    out = two_call_record()["response"]["output"]
    carrying = [i for i, item in enumerate(out) if "generation_token_ids" in item]
    assert carrying == [0, 3]
    assert "generation_token_ids" not in out[2]  # the reasoning item opens the second call


def test_model_calls_returns_each_calls_tokens_in_order():
    calls = model_calls(two_call_record())
    assert [c["generation_token_ids"] for c in calls] == [[3, 4], [6]]
    assert calls[1]["prompt_token_ids"] == [1, 2, 3, 4, 5]


def test_row_fields_and_extras_are_kept():
    rec = two_call_record()
    assert rec["agent_ref"]["name"] == "demo" and rec["hit"] is True and rec["reward"] == 1.0


def test_write_then_read_round_trips_under_rollouts_step_n(tmp_path):
    rec = two_call_record()
    path = write_rollouts(tmp_path, 7, [rec, rec])
    assert path == tmp_path / "rollouts" / "step_7.jsonl"
    assert read_rollouts(path) == [rec, rec]


@pytest.mark.parametrize("env", ENVS)
def test_nemo_gym_recorded_rollouts_pass_validation_unchanged(vectors, tmp_path, env):
    rows = real_rollouts(vectors, env)
    assert read_rollouts(write_rollouts(tmp_path, 1, rows)) == rows


def test_val_rollouts_have_their_own_files(tmp_path):
    write_rollouts(tmp_path, 2, [two_call_record()], split="val")
    write_rollouts(tmp_path, 2, [two_call_record()])
    assert rollout_path(tmp_path, 2, "val").name == "val_step_2.jsonl"
    assert [s for s, _ in rollout_files(tmp_path, "val")] == [2]
    assert [p.name for _, p in rollout_files(tmp_path)] == ["step_2.jsonl"]


def test_mismatched_token_and_logprob_counts_are_refused():
    with pytest.raises(GymvError, match="2 generated tokens but 1 logprobs"):
        attach_model_call_tokens([{"type": "message"}], [1], [2, 3], [-0.1])


def test_a_rollout_without_a_finite_reward_is_refused_naming_the_record(tmp_path):
    rec = two_call_record()
    rec["reward"] = None
    with pytest.raises(GymvError, match="step_1.jsonl record 1"):
        write_rollouts(tmp_path, 1, [two_call_record(), rec])
    assert not (tmp_path / "rollouts" / "step_1.jsonl").exists()


def test_partial_token_fields_are_refused(tmp_path):
    rec = two_call_record()
    del rec["response"]["output"][0]["generation_log_probs"]
    with pytest.raises(GymvError, match="output item 0"):
        write_rollouts(tmp_path, 1, [rec])
