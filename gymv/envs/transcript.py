"""Read a Responses-API transcript turn by turn: which items the model wrote, its last turn, the user's turns.

A transcript (a rollout's `response.output`) interleaves the model's items (assistant messages,
function calls, reasoning) with what the environment added (function_call_output items, user
messages). A model turn is a run of consecutive model items. Multi-turn rewards are about turns — "the
final answer", "the moves made" — so verifiers, the HTTP `/step` endpoint and the remote client read
transcripts through these helpers instead of each re-deriving the grouping.
"""

from __future__ import annotations

import json
from typing import Any

from gymv.envs.protocol import ModelTurn, ToolCall

MODEL_ITEM_TYPES = ("message", "function_call", "reasoning")


def is_model_item(item: Any) -> bool:
    """Whether the model wrote this item (an assistant message, a function call or reasoning)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type", "message")
    if kind == "message":
        return item.get("role", "assistant") == "assistant"
    return kind in ("function_call", "reasoning")


def is_user_message(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user"


def model_turns(output: list[Any]) -> list[list[dict]]:
    """The model's turns: each a list of consecutive model items, in order."""
    turns: list[list[dict]] = []
    current: list[dict] | None = None
    for item in output:
        if is_model_item(item):
            if current is None:
                current = []
                turns.append(current)
            current.append(item)
        else:
            current = None
    return turns


def message_text(item: dict) -> str:
    """The text of one message item (string content or output_text/input_text parts)."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(p["text"] for p in content
                   if isinstance(p, dict) and p.get("type") in ("output_text", "input_text", "text")
                   and isinstance(p.get("text"), str))


def turn_text(items: list[dict]) -> str:
    """The visible text of one model turn (its assistant messages, concatenated)."""
    return "".join(message_text(i) for i in items if i.get("type", "message") == "message")


def final_turn_text(output: list[Any]) -> str:
    """The visible text of the model's last turn ('' when the model never spoke)."""
    turns = model_turns(output)
    return turn_text(turns[-1]) if turns else ""


def user_messages(output: list[Any]) -> list[dict]:
    """The user messages the environment added to the transcript (scripted follow-ups), in order."""
    return [item for item in output if is_user_message(item)]


def _arguments(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(raw)


def turn_from_items(items: list[Any]) -> ModelTurn:
    """The ModelTurn that a model turn's output items describe (non-model items are ignored)."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for k, item in enumerate(items):
        if not is_model_item(item):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            text.append(message_text(item))
        elif kind == "function_call":
            name = item.get("name")
            call_id = item.get("call_id") or item.get("id") or f"call_{k}"
            calls.append(ToolCall(name if isinstance(name, str) else "", _arguments(item.get("arguments", "{}")),
                                  str(call_id)))
        else:
            summary = item.get("summary")
            if isinstance(summary, list):
                reasoning.extend(s["text"] for s in summary if isinstance(s, dict) and isinstance(s.get("text"), str))
    return ModelTurn(text="".join(text), tool_calls=calls, reasoning="\n".join(reasoning) or None)


def function_call_arguments(item: dict) -> dict | None:
    """A function_call item's arguments as a JSON object, or None when they are not one."""
    raw = item.get("arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except (ValueError, RecursionError):
        return None
    return args if isinstance(args, dict) else None
