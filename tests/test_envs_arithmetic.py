"""arithmetic: a text-only environment with `\\boxed{}` integer answers, its presets, and its place in routing."""

from __future__ import annotations

import json
import random

import pytest

from gymv.envs import RowError, env_for_row, get_env
from gymv.envs.arithmetic import evaluate
from gymv.envs.knobs import resolve_knobs
from gymv.errors import GymvError
from gymv.rollout import build_sft_sample
from tiny_models import shared_policy

ENV = get_env("arithmetic")
ROW = {"expression": "2 + 3 * 4", "expected_answer": 14,
       "responses_create_params": {"input": [{"role": "user", "content": "What is 2 + 3 * 4?"}]}}


def said(*texts: str) -> list[dict]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]} for t in texts]


def rows(preset: str, n: int, seed: int = 0, *knobs: str) -> list[dict]:
    k = resolve_knobs(ENV, preset, list(knobs))
    return [ENV.make_row(random.Random(seed + i), k, i) for i in range(n)]


def test_correct_boxed_answer_earns_reward_one():
    s = ENV.score_output(ROW, said("3*4 is 12, plus 2: \\boxed{14}"))
    assert (s.reward, s.failure_reason, s.extras["predicted_answer"]) == (1.0, None, 14)


def test_only_the_first_boxed_answer_counts():
    assert ENV.score_output(ROW, said("\\boxed{20} sorry, \\boxed{14}")).reward == 0.0


def test_a_negative_boxed_answer_is_read_with_its_sign():
    row = {**ROW, "expression": "3 - 5", "expected_answer": -2}
    assert ENV.score_output(row, said("\\boxed{-2}")).reward == 1.0
    assert ENV.score_output(row, said("\\boxed{2}")).failure_reason == "wrong_answer"


def test_no_boxed_answer_is_reward_zero_with_a_reason():
    assert ENV.score_output(ROW, said("fourteen")).failure_reason == "no_boxed_answer"


def test_multiplication_binds_tighter_than_addition_and_subtraction():
    assert evaluate([2, "+", 3, "*", 4]) == 14
    assert evaluate([10, "-", 2, "*", 3, "+", 1]) == 5
    assert evaluate([9, "-", 4, "-", 3]) == 2


def test_every_generated_row_states_the_value_of_its_expression():
    for row in rows("default", 200):
        tokens = [int(t) if t.isdigit() else t for t in row["expression"].split()]
        assert row["expected_answer"] == evaluate(tokens)


def test_rows_are_text_only_with_the_agent_that_serves_them():
    for row in rows("default", 20) + rows("tiny", 20):
        blob = json.dumps(row)
        assert "input_image" not in blob and "data:image" not in blob
        assert row["agent_ref"] == {"type": "responses_api_agents", "name": "arithmetic_simple_agent"}


def test_tiny_preset_asks_a_one_digit_sum_without_a_system_prompt():
    for row in rows("tiny", 50):
        a, op, b = row["expression"].split()
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert row["responses_create_params"]["input"] == [{"role": "user", "content": f"{a} + {b}=?"}]


def test_gold_turn_of_generated_rows_earns_full_reward():
    for row in rows("default", 30):
        out = ENV.gold_turn(row).to_items()
        assert ENV.score_output(row, out).reward == 1.0


def test_row_without_the_expected_answer_is_a_data_error_naming_the_field():
    with pytest.raises(RowError, match="expected_answer"):
        ENV.check_row({"expression": "1 + 1"}, where="x.jsonl line 3")


def test_a_non_integer_expected_answer_is_a_data_error():
    with pytest.raises(RowError, match="must be an integer"):
        ENV.check_row({"expression": "1 + 1", "expected_answer": "2"})


def test_unknown_operator_knob_is_refused():
    with pytest.raises(GymvError, match="unknown operator"):
        resolve_knobs(ENV, "default", ["ops=+,/"])


def test_knobs_reshape_the_task():
    for row in rows("tiny", 30, 0, "ops=*", "terms=3", "operands=2:3"):
        assert row["expression"].count("*") == 2


def test_rows_route_to_arithmetic_by_agent_name():
    assert env_for_row(rows("tiny", 1)[0]).name == "arithmetic"


def test_a_vlm_student_lays_out_a_text_only_row_without_image_tokens():
    policy = shared_policy("tiny-llava")
    row = rows("tiny", 1)[0]
    traj = build_sft_sample(ENV, row, policy.adapter, policy.tokenizer, policy.chat_template, max_seq_len=256)
    assert traj.error is None and traj.reward == 1.0 and not traj.images
    assert policy.adapter.count_placeholders(traj.token_ids) == 0
    gold = policy.tokenizer.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m], skip_special_tokens=True)
    assert gold == f"\\boxed{{{row['expected_answer']}}}"
