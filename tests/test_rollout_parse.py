"""Reading tool calls and reasoning out of generated text."""

from __future__ import annotations

import json

from gymv.envs import get_env
from gymv.rollout import parse_turn


def test_several_tool_calls_in_one_turn_keep_their_order_and_ids():
    turn = parse_turn('Let me click.<tool_call>{"name": "click", "arguments": {"x": 1, "y": 2}}</tool_call>\n'
                      '<tool_call>{"name": "click", "arguments": {"x": 3, "y": 4}}</tool_call>', "call_7")
    assert turn.text == "Let me click."
    assert [(c.name, json.loads(c.arguments), c.call_id) for c in turn.tool_calls] == [
        ("click", {"x": 1, "y": 2}, "call_7_0"), ("click", {"x": 3, "y": 4}, "call_7_1")]


def test_text_without_tool_calls_is_the_whole_message():
    turn = parse_turn("The answer is \\boxed{3}.")
    assert turn.text == "The answer is \\boxed{3}." and turn.tool_calls == [] and turn.reasoning is None


def test_arguments_given_as_a_json_string_are_kept_as_written():
    (call,) = parse_turn('<tool_call>{"name": "click", "arguments": "{\\"x\\": 5, \\"y\\": 6}"}</tool_call>').tool_calls
    assert json.loads(call.arguments) == {"x": 5, "y": 6}


def test_invalid_json_keeps_the_intended_name_and_becomes_a_json_error_result():
    env = get_env("circle-click")
    (call,) = parse_turn('<tool_call>{"name": "click", "arguments": {"x": 1,</tool_call>').tool_calls
    assert call.name == "click"
    result = env.execute(None, call)
    assert result.error.startswith("click: arguments are not valid JSON")


def test_unclosed_tool_call_at_the_end_still_counts_as_a_call():
    (call,) = parse_turn('ok <tool_call>{"name": "click", "arguments": {"x": 1, "y"').tool_calls
    assert call.name == "click"
    assert get_env("circle-click").execute(None, call).error is not None


def test_missing_name_or_non_object_becomes_an_unknown_tool_error():
    env = get_env("circle-click")
    for body in ('{"arguments": {"x": 1, "y": 2}}', '[1, 2]', '"click"'):
        (call,) = parse_turn(f"<tool_call>{body}</tool_call>").tool_calls
        assert "unknown tool ''" in env.execute(None, call).error


def test_wrong_argument_types_are_reported_by_the_environment():
    (call,) = parse_turn('<tool_call>{"name": "click", "arguments": {"x": [1, 2], "y": 3}}</tool_call>').tool_calls
    assert "argument 'x' must be an integer" in get_env("circle-click").execute(None, call).error


def test_think_blocks_become_reasoning_and_their_tool_calls_do_not_run():
    turn = parse_turn('<think>maybe <tool_call>{"name": "click", "arguments": {}}</tool_call></think>Answer: 4')
    assert turn.reasoning.startswith("maybe") and turn.text == "Answer: 4" and turn.tool_calls == []
    assert [i["type"] for i in turn.to_items()] == ["reasoning", "message"]
