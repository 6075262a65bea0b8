"""Rendering only what a turn adds gives exactly the text the template makes of the whole conversation."""

from __future__ import annotations

import pytest

from gymv.envs.protocol import Image, Message, Text, ToolResult
from gymv.errors import GymvError
from gymv.rollout.render import ChatRenderer, message_dict, tool_message_dict
from tiny_models import shared_policy, solid

# A Qwen-style template: a default system prompt when none is given, and a newline after every <|im_end|>.
QWEN_STYLE = (
    "{%- if messages[0].role != 'system' -%}<|im_start|>system{{ '\\n' }}You are helpful.<|im_end|>{{ '\\n' }}{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}{{ '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}"
    "{%- if p.type == 'image' -%}<image>{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def conversation():
    prompt = [Message("user", [Image.from_pil(solid((1, 2, 3))), Text("Look.")])]
    tool = ToolResult("call_0", "look", "here", [Image.from_pil(solid((9, 9, 9)))])
    follow = Message("user", [Text("And now?")])
    return prompt, tool, follow


@pytest.mark.parametrize("template", ["tiny", "qwen-style"])
def test_prompt_plus_sample_plus_addition_equals_the_full_rendering(policy, template):
    chat = policy.chat_template if template == "tiny" else QWEN_STYLE
    r = ChatRenderer(policy.tokenizer, chat)
    prompt, tool, follow = conversation()
    head, head_images = r.prompt(prompt, None)
    added, added_images = r.addition([tool_message_dict(tool), message_dict(follow)], turn_closed=True)
    full = r.render([message_dict(m)[0] for m in prompt] + [{"role": "assistant", "content": "Hi."},
                    tool_message_dict(tool)[0], message_dict(follow)[0]], add_generation_prompt=True)
    assert head + "Hi.<|im_end|>" + added == full
    assert len(head_images) == 1 and len(added_images) == 1
    assert r.glue == ("" if template == "tiny" else "\n")


def test_a_turn_the_model_left_open_gets_the_end_of_turn_text(policy):
    r = ChatRenderer(policy.tokenizer, QWEN_STYLE)
    closed, _ = r.addition([message_dict(Message("user", [Text("x")]))], turn_closed=True)
    opened, _ = r.addition([message_dict(Message("user", [Text("x")]))], turn_closed=False)
    assert opened == "<|im_end|>" + closed and closed.startswith("\n<|im_start|>user")


def test_template_whose_assistant_turn_ends_otherwise_is_refused(policy):
    bad = "{%- for m in messages -%}{{ m.role }}: {{ m.content }}</s>{%- endfor -%}"
    with pytest.raises(GymvError, match="does not end an assistant turn with the eos token"):
        ChatRenderer(policy.tokenizer, bad)
