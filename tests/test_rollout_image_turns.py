"""Per-turn image attribution (ARCHITECTURE §4): every image belongs to the turn that introduced it, whatever
the model turn before it carried, and a sequence whose image spans are off is a clear error naming the row
and the turn, never a silent wrong tensor.

Turn 0 is the prompt; turn k is what the environment added after model call k-1. The prompt, a tool result
and a scripted follow-up are covered with PictureEnv in test_rollout_multi_turn.py; here StagedEnv adds
images after turns that hold only reasoning, only a function call, reasoning and a call, several calls.
"""

from __future__ import annotations

import pytest

from gymv.backends.generation import SamplingParams
from gymv.backends.generation.base import GenerationBackend, GenerationOutput
from gymv.envs.protocol import Environment, Image, Message, ModelTurn, Score, Text, Tool, ToolOutput
from gymv.errors import GymvError
from gymv.rollout import check_trajectory_images, run_rollouts, to_rollout_record
from gymv.runs.rollout_log import validate_rollout
from rollout_helpers import BLUE, GREEN, RED, PictureEnv, ScriptedBackend, picture_row, sample_of, script, turn_of
from tiny_models import shared_policy, solid

YELLOW = (230, 230, 0)
END = "<|im_end|>"


def call(name: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'


class StagedEnv(Environment):
    """Tools `red` and `yellow` answer with a picture of that color, `caption` with text that holds the
    tiny model's image placeholder; `follow_ups[k]` is the user message after the k-th model turn."""

    name = "staged-test"
    agent_name = "staged_test_agent"
    max_turns = 4

    def __init__(self, follow_ups: dict[int, list] | None = None):
        super().__init__()
        self.follow_ups = follow_ups or {}

    def tool_specs(self):
        empty = {"type": "object", "properties": {}}
        return [Tool("red", "A red picture.", empty, lambda s, a: ToolOutput("red:", [Image.from_pil(solid(RED))])),
                Tool("yellow", "A yellow picture.", empty,
                     lambda s, a: ToolOutput("", [Image.from_pil(solid(YELLOW, (32, 32)))])),
                Tool("caption", "A caption.", empty, lambda s, a: ToolOutput("see <image> above"))]

    def follow_up(self, state, turn, results):
        parts = self.follow_ups.get(state.turns)
        return [Message("user", list(parts))] if parts else []

    def score_output(self, row, output):
        from gymv.envs.rows import output_text

        return Score(1.0 if "done" in output_text(output) else 0.0)

    def gold_turn(self, row):
        return ModelTurn(text="done")


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def run(policy, env, replies: list[str], *, group_size=1, backend=None):
    backend = backend or ScriptedBackend(policy, lambda w: replies[turn_of(w)])
    return run_rollouts(backend, policy.adapter, policy.tokenizer, policy.chat_template, env, [(0, picture_row())],
                        group_size=group_size, params=SamplingParams(max_new_tokens=48), max_turns=4,
                        max_rollout_tokens=512, max_seq_len=2048, seed=0)


def span_starts(t, policy) -> list[int]:
    """Where each image's placeholder span starts (a LLaVA image needs a fixed number of tokens)."""
    ids, tok = t.token_ids, policy.adapter.image_token_id
    n = policy.adapter.tokens_per_image(t.images[0])
    out = []
    for s in (k for k, x in enumerate(ids) if x == tok and (k == 0 or ids[k - 1] != tok)):
        e = s
        while e < len(ids) and ids[e] == tok:
            e += 1
        out += range(s, e, n)
    return out


def gap_of(pos: int, t) -> int:
    """The turn whose inserted text holds token `pos`: 0 before the first model call, k after call k-1."""
    for c in t.model_calls:
        assert not c["generation_start"] <= pos < c["generation_end"], "an image span inside sampled tokens"
    return sum(1 for c in t.model_calls if c["generation_end"] <= pos)


def assert_attributed(t, policy, turns: list[int], colors: list[tuple]):
    assert t.image_turns == turns
    assert [im.getpixel((0, 0)) for im in t.images] == colors
    assert [gap_of(s, t) for s in span_starts(t, policy)] == turns
    policy.adapter.check(t.token_ids, t.images, where="test")
    check_trajectory_images(t, policy.adapter)


def test_reasoning_only_turn_then_a_tool_image_belongs_to_the_turn_after_the_call(policy):
    env = StagedEnv({1: [Text("Go on.")]})
    (t,) = run(policy, env, [f"<think>Which one?</think>{END}", call("red") + END, "done" + END])
    assert t.turns == 3 and t.reward == 1.0
    assert [i["type"] for i in t.output[:2]] == ["reasoning", "message"]
    assert_attributed(t, policy, [0, 2], [GREEN, RED])


def test_reasoning_only_turn_followed_by_a_follow_up_image(policy):
    env = StagedEnv({1: [Text("This one:"), Image.from_pil(solid(BLUE))]})
    (t,) = run(policy, env, [f"<think>I need another view.</think>{END}", "done" + END])
    assert t.turns == 2 and t.output[0]["type"] == "reasoning"
    assert_attributed(t, policy, [0, 1], [GREEN, BLUE])


def test_function_call_only_turn_puts_its_tool_image_in_the_next_turn(policy):
    (t,) = run(policy, StagedEnv(), [call("red") + END, "done" + END])
    assert [i["type"] for i in t.output] == ["function_call", "function_call_output", "message"]
    assert_attributed(t, policy, [0, 1], [GREEN, RED])
    record = to_rollout_record(t)
    validate_rollout(record, where="staged")
    assert "generation_token_ids" in record["response"]["output"][0]  # the call item carries turn 0's tokens


def test_reasoning_and_call_without_text_puts_its_tool_image_in_the_next_turn(policy):
    (t,) = run(policy, StagedEnv(), [f"<think>Look at red.</think>{call('red')}{END}", "done" + END])
    assert [i["type"] for i in t.output[:3]] == ["reasoning", "function_call", "function_call_output"]
    assert_attributed(t, policy, [0, 1], [GREEN, RED])


def test_several_tool_images_and_a_follow_up_image_of_one_turn_keep_their_order(policy):
    env = StagedEnv({1: [Image.from_pil(solid(BLUE)), Text("Which came first?")]})
    (t,) = run(policy, env, [call("yellow") + call("red") + END, "done" + END])
    assert_attributed(t, policy, [0, 1, 1, 1], [GREEN, YELLOW, RED, BLUE])


def test_images_of_later_turns_follow_each_other(policy):
    env = StagedEnv({2: [Image.from_pil(solid(BLUE))]})
    (t,) = run(policy, env, [call("red") + END, call("yellow") + END, "done" + END])
    assert_attributed(t, policy, [0, 1, 2, 2], [GREEN, RED, YELLOW, BLUE])


# --------------------------------------------------------------------------------- the placeholder check


class UnmaskedBackend(GenerationBackend):
    """A backend that forgot to mask vision tokens: it says the tokenizer's ids of `reply(where)`."""

    def __init__(self, policy, reply):
        self.tok, self.reply = policy.tokenizer, reply

    def generate(self, requests, params):
        outs = []
        for r in requests:
            ids = self.tok.encode(self.reply(r.where), add_special_tokens=False)
            outs.append(GenerationOutput(ids, [0.0] * len(ids), self.tok.decode(ids, skip_special_tokens=True),
                                         "stop", ids[-1]))
        return outs

    def update_weights(self, state_dict):
        pass

    def reset_encoder_cache(self):
        pass

    def stats(self):
        return {}


def test_a_sampled_image_placeholder_raises_naming_the_row_and_turn(policy):
    replies = [call("red") + END, "it is <image> here" + END]
    with pytest.raises(GymvError, match=r"row 0 sample 1, turn 1: the generation backend sampled 1 vision special"):
        run(policy, StagedEnv(), replies, group_size=2,
            backend=UnmaskedBackend(policy, lambda w: replies[turn_of(w)] if sample_of(w) == 1 else "done" + END))


def test_environment_text_that_reads_as_a_placeholder_marks_only_its_episode(policy):
    replies = {0: call("caption") + END, 1: call("red") + END}
    backend = ScriptedBackend(policy, lambda w: replies[sample_of(w)] if turn_of(w) == 0 else "done" + END)
    bad, good = run(policy, StagedEnv(), [], group_size=2, backend=backend)
    assert bad.finish_reason == "error" and "turn 1" in bad.error and "image placeholder" in bad.error
    assert bad.image_turns == [0] and bad.turns == 1
    assert good.error is None and good.image_turns == [0, 1] and good.reward == 1.0


@pytest.fixture(scope="module")
def pictures(policy):
    (t,) = run_rollouts(ScriptedBackend(policy, script), policy.adapter, policy.tokenizer, policy.chat_template,
                        PictureEnv(), [(0, picture_row())], group_size=1, params=SamplingParams(max_new_tokens=48),
                        max_turns=3, max_rollout_tokens=256, max_seq_len=1024, seed=0)
    assert t.image_turns == [0, 1, 2]
    return t


def corrupt(t, policy, image: int, delta: int):
    from dataclasses import replace

    tok = policy.adapter.image_token_id
    starts = [k for k, x in enumerate(t.token_ids) if x == tok and t.token_ids[k - 1] != tok]
    ids = list(t.token_ids)
    if delta < 0:
        del ids[starts[image]]
    else:
        ids.insert(starts[image], tok)
    shift = len(ids) - len(t.token_ids)
    calls = [{**c, **{k: c[k] + shift for k in ("prompt_end", "generation_start", "generation_end")
                      if c[k] > starts[image]}} for c in t.model_calls]
    return replace(t, token_ids=ids, model_calls=calls)


@pytest.mark.parametrize("image,turn,what", [(0, 0, "the prompt"), (1, 1, "a tool result"),
                                             (2, 2, "a scripted follow-up")])
def test_a_corrupted_span_is_an_error_naming_the_row_and_the_turn_that_introduced_it(policy, pictures, image, turn,
                                                                                      what):
    bad = corrupt(pictures, policy, image, -1)
    with pytest.raises(GymvError, match=rf"row 0 sample 0, turn {turn}: the image placeholder span .* image {image} "
                                        rf"\(introduced at turn {turn}\) needs 64") as e:
        check_trajectory_images(bad, policy.adapter)
    assert "do not match the images" in str(e.value)


def test_a_span_grown_by_one_token_is_caught_too(policy, pictures):
    with pytest.raises(GymvError, match=r"turn 1: the image placeholder span at token \d+ \(inserted at turn 1\) has 65"):
        check_trajectory_images(corrupt(pictures, policy, 1, +1), policy.adapter)


def test_an_intact_multi_turn_trajectory_passes_the_check(policy, pictures):
    check_trajectory_images(pictures, policy.adapter)
