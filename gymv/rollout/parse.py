"""Read a model turn out of generated text: visible text, tool calls and `<think>` reasoning.

The tool-call syntax is the recipe's `rollout.tool_call_format` (gymv.rollout.tool_formats; default
`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn). A call that is not
valid JSON, lacks a name or is left unclosed still becomes a tool call, so the environment answers it with a
tool-error result the model can learn from (never a crash, never silently dropped): `Environment.execute`
reports invalid JSON, unknown tools and arguments that break the schema. `qwen3_coder` reads as vLLM's parser
does: where that parser gives up on a turn, the turn is a plain message without a call.
"""

from __future__ import annotations

from gymv.envs.protocol import ModelTurn
from gymv.rollout.tool_formats import ToolCallFormat, get_tool_call_format


def parse_turn(text: str, call_id_prefix: str = "call", tool_call_format: str | ToolCallFormat | None = None,
               tools: list[dict] | None = None) -> ModelTurn:
    """The ModelTurn of one generation; call ids are `<prefix>_<k>` so transcripts are deterministic. `tools`
    (the turn's tool schemas, chat-template form) reach a format that types arguments by them (qwen3_coder)."""
    fmt = get_tool_call_format(tool_call_format)
    return fmt.parse(text, call_id_prefix, tools=tools) if fmt.needs_tools else fmt.parse(text, call_id_prefix)
