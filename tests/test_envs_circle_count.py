"""circle-count: NeMo Gym's reward rule, its generator defaults, the tiny preset, and NeMo-identical images."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from gymv.data.images import decode_data_url
from gymv.envs import ModelTurn, RowError, get_env
from gymv.envs.circles import render
from gymv.envs.knobs import resolve_knobs

ENV = get_env("circle-count")
ROW = {
    "circles": [{"x": 10, "y": 10, "radius": 5, "color": "red"}, {"x": 30, "y": 10, "radius": 5, "color": "red"},
                {"x": 50, "y": 10, "radius": 5, "color": "blue"}],
    "target_color": "red",
}


def said(*texts: str) -> list[dict]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]} for t in texts]


def test_correct_boxed_count_earns_reward_one():
    s = ENV.score_output(ROW, said("I see two red ones. \\boxed{2}"))
    assert (s.reward, s.failure_reason) == (1.0, None)
    assert s.extras == {"predicted_count": 2, "expected_count": 2, "correct": True}


def test_only_the_first_boxed_answer_counts():
    assert ENV.score_output(ROW, said("\\boxed{3} no wait \\boxed{2}")).reward == 0.0


def test_boxed_answers_are_searched_across_all_assistant_messages():
    assert ENV.score_output(ROW, said("Counting...", "\\boxed{2}")).reward == 1.0


def test_no_boxed_answer_is_reward_zero_with_a_reason():
    s = ENV.score_output(ROW, said("There are 2 red circles."))
    assert (s.reward, s.failure_reason, s.extras["predicted_count"]) == (0.0, "no_boxed_answer", None)


def test_a_boxed_word_is_not_an_answer():
    assert ENV.score_output(ROW, said("\\boxed{two}")).failure_reason == "no_boxed_answer"


def test_wrong_count_is_reward_zero_with_a_reason():
    s = ENV.score_output(ROW, said("\\boxed{3}"))
    assert (s.reward, s.failure_reason) == (0.0, "wrong_count")


def test_text_in_tool_calls_and_user_messages_is_not_read_as_the_answer():
    output = [{"type": "function_call", "name": "x", "arguments": "{\"a\": \"\\\\boxed{2}\"}", "call_id": "c"},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "\\boxed{2}"}]}]
    assert ENV.score_output(ROW, output).failure_reason == "no_boxed_answer"


def test_row_without_circles_is_a_data_error_naming_the_field():
    with pytest.raises(RowError, match="'circles'"):
        ENV.verify({"target_color": "red", "response": {"output": said("\\boxed{1}")}})


def test_circles_without_colors_are_a_data_error():
    with pytest.raises(RowError, match=r"circles\[0\]"):
        ENV.verify({"circles": [{"x": 1}], "target_color": "red", "response": {"output": []}})


def test_gold_answer_is_the_boxed_count():
    assert ENV.gold_answer(ROW) == "\\boxed{2}"


def test_gold_turn_of_generated_rows_earns_full_reward():
    for preset in ("default", "tiny"):
        knobs = resolve_knobs(ENV, preset)
        for seed in range(20):
            row = ENV.make_row(random.Random(seed), knobs, seed)
            state = ENV.start(row)
            ENV.step(state, ENV.gold_turn(row))
            assert ENV.score(state).reward == 1.0


def test_episode_ends_after_one_answer():
    state = ENV.start({**ROW, "responses_create_params": {"input": "How many red circles?"}})
    result = ENV.step(state, ModelTurn(text="\\boxed{2}"))
    assert result.done and result.tool_results == []


def test_default_rows_follow_nemo_gym_generator_defaults():
    knobs = resolve_knobs(ENV, "default")
    for seed in range(30):
        row = ENV.make_row(random.Random(seed), knobs, seed)
        colors = {c["color"] for c in row["circles"]}
        assert {c["radius"] for c in row["circles"]} <= set(range(30, 61))
        assert len({c["radius"] for c in row["circles"]}) == 1
        assert 1 <= len(row["circles"]) <= 20 and len(colors) <= 4
        assert decode_data_url(row["responses_create_params"]["input"][1]["content"][0]["image_url"]).size == (1000, 1000)


def test_tiny_preset_draws_one_to_three_same_color_circles_of_radius_seven_on_56_pixels():
    knobs = resolve_knobs(ENV, "tiny")
    counts = set()
    for seed in range(60):
        row = ENV.make_row(random.Random(seed), knobs, seed)
        circles = row["circles"]
        counts.add(len(circles))
        assert {c["color"] for c in circles} == {row["target_color"]}
        assert all(c["radius"] == 7 for c in circles)
        for i, a in enumerate(circles):  # non-overlapping
            for b in circles[i + 1:]:
                assert (a["x"] - b["x"]) ** 2 + (a["y"] - b["y"]) ** 2 > 14 ** 2
        image = row["responses_create_params"]["input"][-1]["content"][0]["image_url"]
        assert decode_data_url(image).size == (56, 56)
    assert counts == {1, 2, 3}


def test_tiny_preset_prompt_is_one_short_question():
    row = ENV.make_row(random.Random(0), resolve_knobs(ENV, "tiny"), 0)
    messages = row["responses_create_params"]["input"]
    assert [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"][1]["text"] == f"How many {row['target_color']} circles?"


def test_rendered_images_are_pixel_identical_to_nemo_gym_example_rows(vectors):
    for line in (vectors / "nemo_gym" / "circle_count" / "example.jsonl").read_text().splitlines():
        row = json.loads(line)
        theirs = decode_data_url(row["responses_create_params"]["input"][1]["content"][0]["image_url"])
        ours = decode_data_url(render(theirs.width, row["circles"]))
        assert np.array_equal(np.asarray(theirs), np.asarray(ours))
