"""The tiny models' tokenizer and chat template: what the agent loop renders and the parsers read back."""

from __future__ import annotations

import json

import pytest

from tiny_models import shared_policy

TOOLS = [{"type": "function", "function": {"name": "click", "description": "click a point",
          "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}]


def render(policy, messages, **kw) -> str:
    return policy.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=policy.chat_template, **kw)


@pytest.fixture(scope="module")
def llava():
    return shared_policy("tiny-llava")


@pytest.mark.parametrize("text", [
    "There are 12 red circles, so the answer is \\boxed{12}.",
    'Click it: <tool_call>{"name": "click", "arguments": {"x": 412, "y": 87}}</tool_call>',
    "<tool_response>hit</tool_response> ünïcödé ✓ 数字 \t\n  spaces",
    "purple triangle at (999, 0); cyan square; 3.14159",
])
def test_tokenizer_round_trips_text(llava, text):
    ids = llava.tokenizer.encode(text, add_special_tokens=False)
    assert llava.tokenizer.decode(ids) == text


def test_tool_call_markup_is_single_tokens_kept_when_special_tokens_are_skipped(llava):
    tok = llava.tokenizer
    for mark in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        ids = tok.encode(mark, add_special_tokens=False)
        assert len(ids) == 1, mark
        assert tok.decode(ids, skip_special_tokens=True) == mark


def test_tokenizer_is_deterministic_for_a_seed_and_differs_across_seeds():
    from gymv.models.tokenizer import train_bpe

    a, b, c = (train_bpe(s, 600, ["<image>"]).to_str() for s in (3, 3, 4))
    assert a == b
    assert a != c


def test_tokenizer_is_identical_across_processes():
    import subprocess
    import sys

    code = "from gymv.models.tokenizer import train_bpe; print(train_bpe(3, 600, ['<image>']).to_str())"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 1000


def test_chat_template_renders_images_tool_calls_and_tool_results(llava):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click the red circle."}]},
        {"role": "assistant", "content": "Clicking.",
         "tool_calls": [{"type": "function", "function": {"name": "click", "arguments": {"x": 3, "y": 4}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "hit"}, {"type": "image"}]},
    ]
    assert render(llava, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>"
        "<|im_start|>user\n<image>Click the red circle.<|im_end|>"
        '<|im_start|>assistant\nClicking.<tool_call>{"name": "click", "arguments": {"x": 3, "y": 4}}</tool_call><|im_end|>'
        "<|im_start|>tool\n<tool_response>hit<image></tool_response><|im_end|>"
        "<|im_start|>assistant\n"
    )


def test_tool_call_markup_is_the_json_the_parser_expects(llava):
    args = {"x": 3, "y": 4}
    text = render(llava, [{"role": "assistant", "content": "", "tool_calls": [{"name": "click", "arguments": args}]}])
    body = text.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(body) == {"name": "click", "arguments": args}


def test_tools_are_listed_in_the_system_turn(llava):
    text = render(llava, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>")
    assert text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>user\nhi<|im_end|>")


def test_responses_api_content_parts_render_like_chat_parts(llava):
    a = render(llava, [{"role": "user", "content": [{"type": "input_image", "image_url": "data:..."},
                                                     {"type": "input_text", "text": "count"}]}])
    b = render(llava, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}])
    assert a == b


def test_rendering_is_prefix_stable_so_turns_can_be_appended(llava):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "click", "arguments": {"x": 1, "y": 2}}]},
        {"role": "tool", "content": "miss"},
        {"role": "user", "content": "Try again."},
    ]
    whole = render(llava, messages, add_generation_prompt=True)
    pieces = render(llava, messages[:2]) + render(llava, messages[2:], add_generation_prompt=True)
    assert whole == pieces
    tok = llava.tokenizer
    assert tok.encode(whole, add_special_tokens=False) == (
        tok.encode(render(llava, messages[:2]), add_special_tokens=False)
        + tok.encode(render(llava, messages[2:], add_generation_prompt=True), add_special_tokens=False))


def test_unknown_role_is_an_error(llava):
    with pytest.raises(Exception, match="unsupported role: narrator"):
        render(llava, [{"role": "narrator", "content": "x"}])


def test_grid_model_template_wraps_the_image_pad_in_vision_markers():
    qwen = shared_policy("tiny-qwen2vl")
    text = render(qwen, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]}])
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>"
