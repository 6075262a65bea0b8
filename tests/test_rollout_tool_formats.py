"""`rollout.tool_call_format`: the built-in Hermes and Llama 3 JSON forms, plugins by entry point, and the
recipe keys (`rollout.tool_call_format`, `generation.chat_template_kwargs`) reaching the workers."""

from __future__ import annotations

import json
import sys

import pytest

from gymv.envs.protocol import ModelTurn, ToolCall
from gymv.errors import GymvError
from gymv.rollout import parse_turn
from gymv.rollout.render import ChatRenderer
from gymv.rollout.tool_formats import available, get_tool_call_format
from tiny_models import shared_policy

REPO_RECIPE = "recipes/grpo.yaml"


def calls(turn: ModelTurn) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in turn.tool_calls]


def test_llama3_reads_a_bare_json_call_after_text():
    turn = parse_turn('I will click. {"name": "click", "parameters": {"x": 3, "y": 4}}', "c", "llama3")
    assert turn.text == "I will click." and calls(turn) == [("click", {"x": 3, "y": 4})]
    assert turn.tool_calls[0].call_id == "c_0"


def test_llama3_reads_several_calls_after_the_python_tag():
    turn = parse_turn('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 1}}', "c",
                      "llama3")
    assert calls(turn) == [("a", {}), ("b", {"k": 1})] and turn.text == ""


def test_llama3_leaves_json_that_is_not_a_call_in_the_text():
    turn = parse_turn('The answer is {"value": 3} and \\boxed{3}.', "c", "llama3")
    assert turn.tool_calls == [] and turn.text == 'The answer is {"value": 3} and \\boxed{3}.'


def test_hermes_ignores_a_bare_json_call_and_llama3_a_tagged_one():
    bare = '{"name": "click", "parameters": {"x": 1}}'
    tagged = '<tool_call>{"name": "click", "arguments": {"x": 1}}</tool_call>'
    assert parse_turn(bare, "c", "hermes").tool_calls == [] and len(parse_turn(tagged, "c", "hermes").tool_calls) == 1
    assert len(parse_turn(bare, "c", "llama3").tool_calls) == 1


def test_an_unknown_format_lists_the_registered_ones():
    with pytest.raises(GymvError, match="hermes, llama3") as e:
        get_tool_call_format("xml")
    assert e.value.where == "rollout.tool_call_format"


def test_a_plugin_format_registers_by_entry_point(tmp_path, monkeypatch):
    (tmp_path / "bracket_fmt.py").write_text(
        "import json\n"
        "from gymv.envs.protocol import ModelTurn, ToolCall\n"
        "from gymv.rollout.tool_formats import ToolCallFormat\n"
        "class Bracket(ToolCallFormat):\n"
        "    name = 'bracket'\n"
        "    def parse(self, text, call_id_prefix='call'):\n"
        "        name, _, rest = text.partition('[')\n"
        "        return ModelTurn(tool_calls=[ToolCall(name.strip(), rest.rstrip(']') or '{}', call_id_prefix + '_0')])\n"
        "    def write_calls(self, calls):\n"
        "        return ''.join(f'{n}[{json.dumps(a)}]' for n, a in calls)\n")
    dist = tmp_path / "bracket_fmt-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bracket-fmt\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gymv.tool_call_formats]\nbracket = bracket_fmt:Bracket\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "bracket" in available()
    turn = parse_turn('click[{"x": 2}]', "c", "bracket")
    assert calls(turn) == [("click", {"x": 2})]
    sys.modules.pop("bracket_fmt", None)


def test_sft_gold_turns_are_written_in_the_recipes_format_where_the_template_writes_another():
    policy = shared_policy("tiny-qwen3")  # its template writes Hermes <tool_call> blocks
    turn = ModelTurn(text="Clicking.", tool_calls=[ToolCall("click", '{"x": 3, "y": 4}', "c_0")])
    conversation = [{"role": "user", "content": "Click the dot."}]
    hermes = ChatRenderer(policy.tokenizer, policy.chat_template, tool_call_format="hermes").assistant(
        conversation, None, turn)
    llama = ChatRenderer(policy.tokenizer, policy.chat_template, tool_call_format="llama3").assistant(
        conversation, None, turn)
    assert "<tool_call>" in hermes and calls(parse_turn(hermes, "c", "hermes")) == [("click", {"x": 3, "y": 4})]
    assert "<tool_call>" not in llama and calls(parse_turn(llama, "c", "llama3")) == [("click", {"x": 3, "y": 4})]
    assert llama.endswith("<|im_end|>")


def test_the_recipe_keys_reach_the_workers_specs():
    from gymv.config import load_config
    from gymv.train.setup import worker_spec

    cfg = load_config(REPO_RECIPE, ["rollout.tool_call_format=llama3", "generation.chat_template_kwargs={enable_thinking: false}",
                                    "model.trust_remote_code=true"])
    spec = worker_spec(cfg, "some/folder")
    assert (spec.rollout.tool_call_format, spec.generation.chat_template_kwargs, spec.model.trust_remote_code) == (
        "llama3", {"enable_thinking": False}, True)


def test_the_schema_refuses_an_unknown_tool_call_format():
    from gymv.config import load_config

    with pytest.raises(GymvError, match="rollout.tool_call_format"):
        load_config(REPO_RECIPE, ["rollout.tool_call_format=xml"])


def test_a_format_of_the_gymv_tool_call_formats_entry_point_group_is_found_through_the_shared_registry():
    from gymv.rollout.tool_formats import TOOL_CALL_FORMATS
    from train_helpers import plugin_on_path

    with plugin_on_path():
        assert TOOL_CALL_FORMATS.available()["angle"] == "gymv_registry_plugins:AngleFormat"
        turn = parse_turn('Clicking. <<click {"x": 2}>>', "c", "angle")
    assert turn.text == "Clicking." and calls(turn) == [("click", {"x": 2})]


def test_a_broken_format_plugin_is_one_error_naming_it(tmp_path, monkeypatch):
    dist = tmp_path / "broken_fmt-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-fmt\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gymv.tool_call_formats]\nbroken = no_such_module_here:Fmt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(GymvError, match="tool-call format 'broken' \\(no_such_module_here:Fmt\\) failed to load"):
        get_tool_call_format("broken")
