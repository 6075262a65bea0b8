"""`rollout.tool_call_format: qwen3_coder`: the XML tool calls of Nemotron 3 Omni (NeMo RL's `tool_parser:
qwen3_coder`), read as vLLM's parser reads them, written as the Nemotron template writes them, and run through
gymv's agent loop on circle-click, polygon-naming and doorkey with a scripted policy saying them.

The episodes' replies are written out here by hand (`xml`), in the Nemotron 3 template's layout, so that the
loop is tested against that text rather than against the format's own writer.
"""

from __future__ import annotations

import json

import pytest

from envs_scripts import END, turn_of
from gymv.backends.generation import SamplingParams
from gymv.envs.protocol import ModelTurn, ToolCall
from gymv.rollout import build_sft_sample, parse_turn, run_rollouts
from gymv.rollout.render import ChatRenderer
from gymv.rollout.tool_formats import get_tool_call_format
from rollout_helpers import ScriptedBackend, tiny_rows
from tiny_models import shared_policy

FMT = "qwen3_coder"
TYPES = {"i": "integer", "n": "number", "b": "boolean", "s": "string", "o": "object", "a": "array"}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "A test tool.", "parameters": {
    "type": "object", "properties": {k: {"type": t} for k, t in TYPES.items()}, "required": ["i"]}}}]


def xml(name: str, **args) -> str:
    """One call as the Nemotron 3 template writes it (values already as text)."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n"


def read(text: str, tools=TOOLS) -> ModelTurn:
    return parse_turn(text, "c", FMT, tools)


def args_of(turn: ModelTurn) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in turn.tool_calls]


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


# --------------------------------------------------------------------------------------- reading and writing


@pytest.mark.parametrize("key,value", [("i", 12), ("i", -3), ("n", 2.5), ("n", 4), ("b", True), ("b", False),
                                       ("s", "two\nlines"), ("s", "12"), ("o", {"k": [1, 2], "v": "x"}),
                                       ("a", [1, "x", None])])
def test_a_written_call_reads_back_as_the_same_arguments_for_each_schema_type(key, value):
    fmt = get_tool_call_format(FMT)
    assert args_of(read(fmt.write_calls([("f", {key: value})]))) == [("f", {key: value})]


def test_values_are_typed_by_the_schema_as_vllms_parser_types_them():
    turn = read(xml("f", i="007", n="3.0", b="yes", s="null", o="{'k': 1}", a="not json", extra="5"))
    assert args_of(turn) == [("f", {"i": 7, "n": 3, "b": False, "s": None, "o": {"k": 1}, "a": "not json",
                                    "extra": "5"})]


def test_a_tool_the_schemas_do_not_declare_gets_its_values_as_text():
    assert args_of(read(xml("g", i="12"))) == [("g", {"i": "12"})]


def test_several_calls_are_read_in_order_and_the_text_before_the_first_is_the_content():
    turn = read("I will look twice.\n" + xml("f", i="1") + "between\n" + xml("f", i="2") + "after")
    assert args_of(turn) == [("f", {"i": 1}), ("f", {"i": 2})]
    assert turn.text == "I will look twice." and [c.call_id for c in turn.tool_calls] == ["c_0", "c_1"]


def test_reasoning_is_split_off_before_the_calls_are_read():
    turn = read("<think>x is 3</think>" + xml("f", i="3"))
    assert turn.reasoning == "x is 3" and turn.text == "" and args_of(turn) == [("f", {"i": 3})]


def test_a_function_block_without_tool_call_tags_is_still_a_call():
    assert args_of(read("<function=f>\n<parameter=i>\n5\n</parameter>\n</function>")) == [("f", {"i": 5})]


def test_unclosed_tags_run_to_the_next_tag_or_the_end_as_in_vllm():
    assert args_of(read("<tool_call>\n<function=f>\n<parameter=i>\n3\n<parameter=s>\nhi")) == [
        ("f", {"i": 3, "s": "hi"})]


@pytest.mark.parametrize("text", ["<tool_call>\n<function=f\n</tool_call>",
                                  xml("f", i="1") + "<tool_call>\n<function=f",  # one bad call loses the good one too
                                  "<function=f>\n<parameter=i\n</function>", xml("f", n="1e999")])
def test_a_turn_vllm_cannot_read_is_a_plain_message_with_no_call(text):
    turn = read(text)
    assert turn.tool_calls == [] and turn.text == text.strip()


def test_text_without_a_function_tag_has_no_call():
    assert read("<tool_call>12, 30</tool_call>").tool_calls == []


def test_the_recipe_accepts_the_format():
    from conftest import REPO
    from gymv.config import load_config

    assert load_config(REPO / "recipes" / "vlm_grpo.yaml", [f"rollout.tool_call_format={FMT}"]).rollout.tool_call_format == FMT


# ------------------------------------------------------------------------------------ the chat template's side


def test_a_template_declaring_tools_another_way_gets_the_formats_declarations_in_the_system_message(policy):
    renderer = ChatRenderer(policy.tokenizer, policy.chat_template, tool_call_format=FMT)
    from gymv.envs.messages import Message, Text

    text, _ = renderer.prompt([Message("system", [Text("Be brief.")]), Message("user", [Text("Go.")])], TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<function>\n<name>f</name>\n<description>A test tool.</description>\n<parameters>\n" in text
    assert "<parameter>\n<name>i</name>\n<type>integer</type>\n</parameter>" in text
    assert '<required>["i"]</required>' in text and '{"name": <name>' not in text  # no Hermes declarations


def test_a_template_that_declares_the_tools_in_xml_itself_keeps_its_own_declarations(policy):
    own = ("{%- if tools %}<|im_start|>system\n{% for t in tools %}<function>\n<name>{{ t.function.name }}</name>"
           "{% endfor %}<|im_end|>{% endif -%}{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}"
           "<|im_end|>{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    renderer = ChatRenderer(policy.tokenizer, own, tool_call_format=FMT)
    from gymv.envs.messages import Message, Text

    text, _ = renderer.prompt([Message("user", [Text("Go.")])], TOOLS)
    assert text.startswith("<|im_start|>system\n<function>\n<name>f</name><|im_end|>") and "# Tools" not in text


def test_an_sft_gold_turn_is_written_in_xml_where_the_template_writes_hermes(policy):
    renderer = ChatRenderer(policy.tokenizer, policy.chat_template, tool_call_format=FMT)
    turn = ModelTurn(text="Clicking.", tool_calls=[ToolCall("f", '{"i": 3, "s": "a b"}', "c_0")])
    text = renderer.assistant([{"role": "user", "content": "Go."}], TOOLS, turn)
    assert text == "Clicking.\n" + xml("f", i="3", s="a b") + END


# -------------------------------------------------------------------------------- episodes through the loop


def rollout(policy, env, rows, reply, **kw):
    (t,) = run_rollouts(ScriptedBackend(policy, reply), policy.adapter, policy.tokenizer, policy.chat_template,
                        env, rows, group_size=1, params=SamplingParams(max_new_tokens=96), max_turns=env.max_turns,
                        max_rollout_tokens=4096, max_seq_len=4096, seed=0, tool_call_format=FMT, **kw)
    return t


def gold_xml(turn: ModelTurn) -> str:
    """A gold turn as a Nemotron model says it: content, then each call's parameters as text."""
    calls = "".join(xml(c.name, **{k: str(v) for k, v in json.loads(c.arguments).items()}) for c in turn.tool_calls)
    return (turn.text + "\n" if turn.text and calls else turn.text) + calls + END


@pytest.fixture(scope="module", params=["circle-click", "polygon-naming", "doorkey"])
def gold_episode(request, policy):
    env, rows = tiny_rows(request.param, 1)
    golds = env.gold_turns(rows[0][1])
    t = rollout(policy, env, rows, lambda w: gold_xml(golds[turn_of(w)]) if turn_of(w) < len(golds) else "done" + END)
    return env, rows, golds, t


def test_an_episode_said_in_xml_earns_full_reward(gold_episode):
    _, _, golds, t = gold_episode
    assert t.reward == 1.0 and t.error is None and t.turns == len(golds) and t.finish_reason == "stop"


def test_every_xml_call_reaches_the_environment_with_the_arguments_of_the_gold_call(gold_episode):
    _, _, golds, t = gold_episode
    sent = [(i["name"], json.loads(i["arguments"])) for i in t.output if i["type"] == "function_call"]
    assert sent == [(c.name, json.loads(c.arguments)) for g in golds for c in g.tool_calls]
    assert not [i for i in t.output if i["type"] == "function_call_output" and '"error"' in str(i["output"])]


def test_the_sft_sample_in_the_format_is_token_for_token_the_xml_episode(gold_episode, policy):
    env, rows, _, t = gold_episode
    sample = build_sft_sample(env, rows[0][1], policy.adapter, policy.tokenizer, policy.chat_template,
                              max_seq_len=4096, tool_call_format=FMT)
    assert sample.token_ids == t.token_ids and sample.loss_mask == t.loss_mask and sample.reward == 1.0


# How NeMo RL scores a malformed call (vLLM 0.11's qwen3_coder parser, then NeMo Gym's simple_agent and
# circle_click verifier): a call vLLM reads is sent to the tool, whose error the model sees next turn, and the
# verifier reads the first click's int(x), int(y); a turn vLLM cannot read is a plain message, which ends the
# episode with no click.
MALFORMED = {  # name: (turn 0 says, turns, reward, failure_reason, the tool's error contains)
    "unclosed tags": ("<tool_call>\n<function=click>\n<parameter=x>\n{x}\n<parameter=y>\n{y}", 2, 1.0, None, None),
    "unknown function": (xml("tap", x="{x}", y="{y}"), 2, 0.0, "no_click", "unknown tool 'tap'"),
    "a parameter missing": (xml("click", x="{x}"), 2, 0.0, "bad_click_arguments", "missing required argument 'y'"),
    "a word for an integer": (xml("click", x="twelve", y="{y}"), 2, 0.0, "bad_click_arguments",
                              "'x' must be an integer"),
    "a name without its bracket": ("<tool_call>\n<function=click x={x} y={y}\n</tool_call>", 1, 0.0, "no_click", None),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_click_is_scored_as_nemo_rl_scores_it(policy, case):
    said, turns, reward, reason, error = MALFORMED[case]
    env, rows = tiny_rows("circle-click", 1, max_turns=2)
    target = env.target_circle(rows[0][1])
    first = said.format(x=target["x"], y=target["y"]) + END
    t = rollout(policy, env, rows, lambda w: first if turn_of(w) == 0 else "done" + END)
    assert (t.turns, t.reward, t.failure_reason) == (turns, reward, reason)
    errors = [i["output"] for i in t.output if i["type"] == "function_call_output"]
    assert (error in errors[0]) if error else not any('"error"' in e for e in errors)
    if turns == 1 and reward == 0.0:  # vLLM could not read it: the whole text is the turn's message
        assert [i["type"] for i in t.output] == ["message"] and "<function=click" in str(t.output[0]["content"])


def test_a_doorkey_move_outside_the_enum_is_a_tool_error_and_moves_nothing(policy):
    env, rows = tiny_rows("doorkey", 1, max_turns=2)
    t = rollout(policy, env, rows, lambda w: (xml("move", direction="north") if turn_of(w) == 0 else "done") + END)
    out = [i for i in t.output if i["type"] == "function_call_output"]
    assert len(out) == 1 and "error" in out[0]["output"] and t.reward == 0.0 and t.turns == 2


def test_the_model_server_reads_xml_calls_with_the_requests_tools(policy):
    """NeMo Gym's agents call gymv's model server: its replies' calls are read with the request's tools."""
    import urllib.request

    from gymv.rollout.policy_server import PolicyServer

    env, rows = tiny_rows("circle-click", 1)
    backend = ScriptedBackend(policy, lambda w: xml("click", x="12", y="30") + END)
    backend.tokenizer, backend.adapter, backend.chat_template = policy.tokenizer, policy.adapter, policy.chat_template
    with PolicyServer(backend, params=SamplingParams(max_new_tokens=96), max_seq_len=4096, tool_call_format=FMT) as srv:
        req = urllib.request.Request(srv.url + "/v1/responses", method="POST",
                                     data=json.dumps(rows[0][1]["responses_create_params"]).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("click", {"x": 12, "y": 30})]
