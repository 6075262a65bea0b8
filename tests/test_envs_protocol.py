"""The environment protocol: prompts from rows, multi-turn steps with image tool results and scripted
follow-ups, tool-argument validation, and row errors that name the data's fault."""

from __future__ import annotations

import numpy as np
import pytest

from gymv.data.images import ImageError, png_data_url
from gymv.envs import Environment, Image, Message, ModelTurn, RowError, Score, Text, Tool, ToolCall, ToolOutput, get_env
from gymv.envs.protocol import EpisodeState

RED = png_data_url(np.full((4, 4, 3), (255, 0, 0), dtype=np.uint8))


class ShapeQuiz(Environment):
    """A two-turn environment: a tool that answers with an image, then a scripted follow-up question."""

    name = "shape-quiz"
    agent_name = "shape_quiz_agent"
    verifier_fields = ("answer",)
    max_turns = 3

    def tool_specs(self):
        schema = {"type": "object", "properties": {"zoom": {"type": "integer", "minimum": 1}}, "required": ["zoom"],
                  "additionalProperties": False}
        return [Tool("look", "Look at the shape.", schema, self._look)]

    def _look(self, state, args):
        state.data["looks"] = state.data.get("looks", 0) + 1
        return ToolOutput(f"zoom {args['zoom']}", [Image(RED)])

    def follow_up(self, state, turn, results):
        if state.turns == 1:
            return [Message("user", [Text("And its color?")])]
        return []

    def score_output(self, row, output):
        from gymv.envs.rows import output_text

        ok = row["answer"] in output_text(output).lower()
        return Score(1.0 if ok else 0.0, {}, None if ok else "wrong")

    def gold_turn(self, row):
        return ModelTurn(text=row["answer"])


ROW = {"responses_create_params": {"input": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "input_image", "image_url": RED, "detail": "auto"},
                                 {"type": "input_text", "text": "What shape?"}]}]},
    "answer": "red"}


def test_initial_messages_carry_text_and_images_from_the_row():
    system, user = ShapeQuiz().initial_messages(ROW)
    assert (system.role, system.text) == ("system", "Be brief.")
    assert user.text == "What shape?" and user.images == [Image(RED, "auto")]


def test_a_string_input_is_one_user_message():
    (msg,) = ShapeQuiz().initial_messages({"responses_create_params": {"input": "Hi"}, "answer": "x"})
    assert (msg.role, msg.text) == ("user", "Hi")


def test_image_url_that_is_not_a_data_url_is_a_row_error_naming_the_part():
    row = {"responses_create_params": {"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "answer": "red"}
    with pytest.raises(ImageError) as e:
        ShapeQuiz().start(row, where="rows.jsonl:4")
    assert "rows.jsonl:4" in e.value.one_line() and "input[0].content[0]" in e.value.one_line()


def test_row_missing_a_verifier_field_is_refused_at_start():
    with pytest.raises(RowError, match="'answer'"):
        ShapeQuiz().start({"responses_create_params": {"input": "Hi"}})


def test_unsupported_content_part_is_a_row_error():
    row = {"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "answer": "x"}
    with pytest.raises(RowError, match="unsupported content type 'input_audio'"):
        ShapeQuiz().start(row)


def test_tool_result_with_an_image_becomes_a_function_call_output_with_image_parts():
    env = ShapeQuiz()
    state = env.start(ROW)
    step = env.step(state, ModelTurn(tool_calls=[ToolCall("look", '{"zoom": 2}', "c1")]))
    (result,) = step.tool_results
    assert result.text == "zoom 2" and result.images == [Image(RED)]
    assert state.output[-2] == {"type": "function_call_output", "call_id": "c1", "output": [
        {"type": "input_text", "text": "zoom 2"}, {"type": "input_image", "image_url": RED, "detail": "auto"}]}


def test_scripted_follow_up_is_returned_and_recorded_and_the_episode_continues():
    env = ShapeQuiz()
    state = env.start(ROW)
    step = env.step(state, ModelTurn(text="A square."))
    assert not step.done and step.user_messages[0].text == "And its color?"
    assert state.output[-1] == {"type": "message", "role": "user", "content": "And its color?"}


def test_episode_ends_when_the_model_answers_without_tools_and_no_follow_up_remains():
    env = ShapeQuiz()
    state = env.start(ROW)
    env.step(state, ModelTurn(text="A square."))
    assert env.step(state, ModelTurn(text="It is red.")).done
    assert env.score(state).reward == 1.0


def test_episode_ends_at_max_turns_even_while_calling_tools():
    env = ShapeQuiz(max_turns=1)
    state = env.start(ROW)
    assert env.step(state, ModelTurn(tool_calls=[ToolCall("look", '{"zoom": 1}')])).done


def test_stepping_a_finished_episode_is_an_error():
    env = ShapeQuiz(max_turns=1)
    state = env.start(ROW)
    env.step(state, ModelTurn(text="red"))
    with pytest.raises(Exception, match="finished episode"):
        env.step(state, ModelTurn(text="again"))


def test_tool_state_lives_in_the_episode():
    env = ShapeQuiz()
    state = env.start(ROW)
    env.step(state, ModelTurn(tool_calls=[ToolCall("look", '{"zoom": 1}'), ToolCall("look", '{"zoom": 3}')]))
    assert state.data["looks"] == 2


def test_tool_argument_below_its_minimum_is_a_tool_error():
    result = ShapeQuiz().execute(EpisodeState(ROW, []), ToolCall("look", '{"zoom": 0}'))
    assert result.error == "look: argument 'zoom' must be at least 1, got 0"


def test_boolean_is_not_accepted_for_an_integer_argument():
    result = ShapeQuiz().execute(EpisodeState(ROW, []), ToolCall("look", '{"zoom": true}'))
    assert "must be an integer, got a boolean" in result.error


def test_integral_float_is_accepted_for_an_integer_argument():
    result = ShapeQuiz().execute(EpisodeState(ROW, []), ToolCall("look", '{"zoom": 2.0}'))
    assert (result.error, result.text) == (None, "zoom 2")


def test_model_turn_items_are_responses_api_output_items():
    items = ModelTurn(text="hi", tool_calls=[ToolCall("click", "{}", "c1")], reasoning="think").to_items()
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0] == {"type": "output_text", "text": "hi", "annotations": []}


def test_verify_adds_reward_and_extras_to_the_body():
    out = get_env("circle-count").verify({"circles": [], "target_color": "red", "x": 1, "response": {"output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{0}"}]}]}})
    assert (out["reward"], out["correct"], out["x"], out["failure_reason"]) == (1.0, True, 1, None)


def test_verify_without_a_response_is_a_row_error():
    with pytest.raises(RowError, match="'response'"):
        get_env("circle-count").verify({"circles": [], "target_color": "red"})
