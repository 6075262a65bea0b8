"""Read a model turn out of generated text: visible text, `<tool_call>` blocks and `<think>` reasoning.

A tool call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a turn may hold several. A block
that is not valid JSON, lacks a name or is left unclosed still becomes a tool call, so the environment
answers it with a tool-error result the model can learn from (never a crash, never silently dropped):
`Environment.execute` reports invalid JSON, unknown tools and arguments that break the schema.
"""

from __future__ import annotations

import json
import re

from gymv.envs.protocol import ModelTurn, ToolCall

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')


def _call(body: str, call_id: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        # Arguments stay the raw block, so execute() reports the JSON error with the name the model meant.
        m = _NAME.search(body)
        return ToolCall(m.group(1) if m else "", body, call_id)
    if not isinstance(obj, dict):
        return ToolCall("", body, call_id)
    name = obj.get("name")
    args = obj.get("arguments", {})
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(name if isinstance(name, str) else "", arguments, call_id)


def parse_turn(text: str, call_id_prefix: str = "call") -> ModelTurn:
    """The ModelTurn of one generation; call ids are `<prefix>_<k>` so transcripts are deterministic."""
    thoughts = [m.group(1).strip() for m in _THINK.finditer(text)]
    text = _THINK.sub("", text)
    calls = [_call(m.group(1).strip(), f"{call_id_prefix}_{k}") for k, m in enumerate(_TOOL_CALL.finditer(text))]
    visible = _TOOL_CALL.sub("", text).strip()
    return ModelTurn(text=visible, tool_calls=calls, reasoning="\n".join(t for t in thoughts if t) or None)
