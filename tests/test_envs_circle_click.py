"""circle-click: NeMo Gym's reward rule, the click tool and its argument checks, generator defaults."""

from __future__ import annotations

import json
import random

import numpy as np

from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, ToolCall, get_env
from gymv.envs.circles import render
from gymv.envs.knobs import resolve_knobs

ENV = get_env("circle-click")
ROW = {
    "circles": [{"x": 100, "y": 100, "radius": 50, "color": "red"}, {"x": 300, "y": 300, "radius": 60, "color": "blue"},
                {"x": 600, "y": 600, "radius": 60, "color": "blue"}],
    "target_color": "blue",
}


def click(arguments, name: str = "click") -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"type": "function_call", "name": name, "arguments": args, "call_id": "c1"}


def test_click_inside_the_target_circle_earns_reward_one():
    s = ENV.score_output(ROW, [click({"x": 310, "y": 290})])
    assert (s.reward, s.failure_reason) == (1.0, None)
    assert s.extras == {"clicked_x": 310, "clicked_y": 290, "hit": True}


def test_click_exactly_on_the_rim_is_a_hit():
    assert ENV.score_output(ROW, [click({"x": 360, "y": 300})]).reward == 1.0


def test_click_just_outside_the_rim_misses():
    s = ENV.score_output(ROW, [click({"x": 361, "y": 300})])
    assert (s.reward, s.failure_reason) == (0.0, "miss")


def test_only_the_first_circle_of_the_target_color_counts():
    assert ENV.score_output(ROW, [click({"x": 600, "y": 600})]).reward == 0.0


def test_only_the_first_click_counts():
    assert ENV.score_output(ROW, [click({"x": 0, "y": 0}), click({"x": 300, "y": 300})]).reward == 0.0


def test_calls_to_other_tools_before_the_click_are_skipped():
    assert ENV.score_output(ROW, [click({"q": 1}, name="zoom"), click({"x": 300, "y": 300})]).reward == 1.0


def test_numeric_strings_and_floats_are_read_with_int_like_nemo_gym():
    s = ENV.score_output(ROW, [click({"x": "300", "y": 299.9})])
    assert (s.reward, s.extras["clicked_x"], s.extras["clicked_y"]) == (1.0, 300, 299)


def test_list_arguments_give_no_click_coordinates():
    s = ENV.score_output(ROW, [click({"x": [290, 310], "y": "300"})])
    assert (s.reward, s.failure_reason, s.extras["clicked_x"], s.extras["clicked_y"]) == (0.0, "bad_click_arguments", None, None)


def test_a_bad_y_keeps_the_parsed_x_as_nemo_gym_reports_it():
    s = ENV.score_output(ROW, [click({"x": 300, "y": [300]})])
    assert (s.extras["clicked_x"], s.extras["clicked_y"], s.reward) == (300, None, 0.0)


def test_unparseable_arguments_are_reward_zero_not_a_crash():
    for bad in ("{not json", '{"x": Infinity, "y": 1}', '{"x": 1e400, "y": 1}', "[1, 2]", '"x"'):
        s = ENV.score_output(ROW, [click(bad)])
        assert (s.reward, s.failure_reason) == (0.0, "bad_click_arguments"), bad


def test_astronomically_far_click_is_a_miss_not_a_crash():
    s = ENV.score_output(ROW, [click('{"x": 1e300, "y": 0}')])
    assert (s.reward, s.failure_reason) == (0.0, "miss")


def test_no_click_at_all_is_reward_zero_with_a_reason():
    out = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "(300, 300)"}]}]
    assert ENV.score_output(ROW, out).failure_reason == "no_click"


def test_click_tool_schema_is_nemo_gyms():
    (tool,) = ENV.tools()
    assert tool["name"] == "click" and tool["strict"] is True and tool["type"] == "function"
    assert tool["parameters"]["required"] == ["x", "y"]
    assert tool["parameters"]["properties"]["x"]["type"] == "integer"


def test_click_tool_echoes_the_point():
    result = ENV.execute(None, ToolCall("click", '{"x": 3, "y": 4}', "c1"))
    assert (result.text, result.error) == ('{"x":3,"y":4}', None)


def test_click_with_a_list_argument_is_a_tool_error_the_model_can_read():
    result = ENV.execute(None, ToolCall("click", '{"x": [1, 2], "y": 4}', "c1"))
    assert result.error == "click: argument 'x' must be an integer, got an array: [1, 2]"
    assert json.loads(result.text) == {"error": result.error}


def test_click_with_a_missing_argument_is_a_tool_error():
    assert "missing required argument 'y'" in ENV.execute(None, ToolCall("click", '{"x": 1}')).error


def test_click_with_an_extra_argument_is_a_tool_error():
    assert "unexpected argument 'z'" in ENV.execute(None, ToolCall("click", '{"x": 1, "y": 2, "z": 3}')).error


def test_click_with_arguments_that_are_not_json_is_a_tool_error():
    assert "not valid JSON" in ENV.execute(None, ToolCall("click", "x=1, y=2")).error


def test_calling_an_unknown_tool_is_a_tool_error():
    assert "unknown tool 'zoom'" in ENV.execute(None, ToolCall("zoom", "{}")).error


def test_click_episode_records_call_and_result_and_ends():
    state = ENV.start({**ROW, "responses_create_params": {"input": "Click the blue circle."}})
    result = ENV.step(state, ModelTurn(tool_calls=[ToolCall("click", '{"x": 300, "y": 300}', "c9")]))
    assert result.done
    assert [i["type"] for i in state.output] == ["function_call", "function_call_output"]
    assert state.output[1] == {"type": "function_call_output", "call_id": "c9", "output": '{"x":300,"y":300}'}
    assert ENV.score(state).reward == 1.0


def test_gold_turn_of_generated_rows_earns_full_reward():
    for preset in ("default", "tiny"):
        knobs = resolve_knobs(ENV, preset)
        for seed in range(20):
            row = ENV.make_row(random.Random(seed), knobs, seed)
            assert ENV.score_output(row, ModelTurn.to_items(ENV.gold_turn(row))).reward == 1.0


def test_default_rows_have_three_to_five_circles_of_distinct_colors_and_radius_60_to_150():
    knobs = resolve_knobs(ENV, "default")
    for seed in range(30):
        row = ENV.make_row(random.Random(seed), knobs, seed)
        colors = [c["color"] for c in row["circles"]]
        assert len(colors) == len(set(colors)) and 1 <= len(colors) <= 5
        assert row["target_color"] in colors
        assert all(60 <= c["radius"] <= 150 for c in row["circles"])


def test_question_lists_the_other_circles_then_the_target():
    row = ENV.make_row(random.Random(4), resolve_knobs(ENV, "default", ["circles=3", "radius=60"]), 0)
    others = [c["color"] for c in row["circles"] if c["color"] != row["target_color"]]
    t = row["target_color"]
    assert row["responses_create_params"]["input"][1]["content"][1]["text"] == (
        f"The picture is 1000 by 1000 pixels and contains a {others[0]} circle, a {others[1]} circle, and a {t} circle. "
        f"Click the {t} circle.")


def test_rendered_images_are_pixel_identical_to_nemo_gym_example_rows(vectors):
    for line in (vectors / "nemo_gym" / "circle_click" / "example.jsonl").read_text().splitlines():
        row = json.loads(line)
        theirs = decode_data_url(row["responses_create_params"]["input"][1]["content"][0]["image_url"])
        ours = decode_data_url(render(theirs.width, row["circles"]))
        assert np.array_equal(np.asarray(theirs), np.asarray(ours))
