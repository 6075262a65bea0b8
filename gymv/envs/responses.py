"""Responses-API objects in the exact shape NeMo Gym validates, for every body gymv sends or logs.

NeMo Gym's servers parse `response` as a full OpenAI `Response` (id, created_at, model, object,
parallel_tool_calls, tool_choice, tools, an `id` on every assistant message and reasoning item, usage with its
token details) and a tool result's `output` as a string. gymv keeps its transcripts in the freer form the rollout
loop builds (tool outputs as lists of input parts, items without ids) and converts them here, at the wire, in one
place: the remote client, the rollout log and the env server all go through `response_object` and `wire_output`.

An image a tool returns cannot travel as a list in NeMo Gym 0.4.0, so it travels as the JSON text of that list
of Responses input parts (`[{"type":"input_text",...},{"type":"input_image","image_url":"data:..."}]`), which is
what NeMo Gym's `simple_agent` already forwards from a tool's body. `decode_parts` reads it back.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

DEFAULT_MODEL = "gymv-policy"
_PART_TYPES = frozenset({"input_text", "input_image"})


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def encode_parts(parts: list[dict]) -> str:
    """A list of input parts as the string a NeMo Gym tool output or observation can carry."""
    return json.dumps(parts, ensure_ascii=False, separators=(",", ":"))


def decode_parts(value: Any) -> Any:
    """The list of input parts a string stands for (see `encode_parts`), else the value unchanged."""
    if not isinstance(value, str) or not value.startswith("[{"):
        return value
    try:
        parts = json.loads(value)
    except ValueError:
        return value
    if isinstance(parts, list) and parts and all(isinstance(p, dict) and p.get("type") in _PART_TYPES for p in parts):
        return parts
    return value


def wire_item(item: Mapping[str, Any]) -> dict:
    """One transcript item as NeMo Gym's output-item models accept it (ids added, list outputs encoded)."""
    out = dict(item)
    kind = out.get("type", "message")
    if kind == "message" and out.get("role", "assistant") == "assistant":
        out["type"] = "message"
        out.setdefault("id", new_id("msg"))
        out.setdefault("status", "completed")
        content = out.get("content")
        if isinstance(content, str):
            content = [{"type": "output_text", "text": content}]
        out["content"] = [({"annotations": [], **p} if isinstance(p, dict) and p.get("type") == "output_text" else p)
                          for p in (content or [])]
    elif kind == "reasoning":
        out.setdefault("id", new_id("rs"))
        out.setdefault("summary", [])
    elif kind == "function_call":
        out.setdefault("id", new_id("fc"))
        out.setdefault("status", "completed")
        if not isinstance(out.get("arguments"), str):
            out["arguments"] = json.dumps(out.get("arguments"))
    elif kind == "function_call_output":
        if not isinstance(out.get("output"), str):
            value = out.get("output")
            out["output"] = encode_parts(value) if isinstance(value, list) else json.dumps(value)
    return out


def wire_output(items: list[Mapping[str, Any]]) -> list[dict]:
    return [wire_item(i) for i in items]


def usage_object(input_tokens: int = 0, output_tokens: int = 0) -> dict:
    return {"input_tokens": int(input_tokens), "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": int(output_tokens), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": int(input_tokens) + int(output_tokens)}


def response_object(output: list[Mapping[str, Any]], *, params: Mapping[str, Any] | None = None,
                    model: str | None = None, usage: Mapping[str, Any] | None = None) -> dict:
    """A complete Responses-API `Response` around `output`, echoing the request's tool settings."""
    params = params or {}
    full_usage = None
    if usage is not None:
        full_usage = usage_object(usage.get("input_tokens", 0), usage.get("output_tokens", 0))
    return {
        "id": new_id("resp"),
        "created_at": float(int(time.time())),
        "error": None,
        "incomplete_details": None,
        "model": model or params.get("model") or DEFAULT_MODEL,
        "object": "response",
        "output": wire_output(list(output)),
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": list(params.get("tools", [])),
        "usage": full_usage,
    }


def request_body(row: Mapping[str, Any], output: list[Mapping[str, Any]], *, model: str | None = None) -> dict:
    """A `/verify` or `/step` body: the row plus a complete `response` (NeMo Gym's BaseVerifyRequest)."""
    return {**row, "response": response_object(output, params=row.get("responses_create_params"), model=model)}
