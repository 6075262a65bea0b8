"""How a model writes tool calls in its text: a registry of formats (`rollout.tool_call_format`).

Built-ins:
- ``hermes``: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3 and the
  tiny models); `<think>...</think>` is reasoning.
- ``llama3``: a bare JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2/3.3 JSON tool calling),
  optionally after `<|python_tag|>`; several calls may follow one another, `;`-separated or not.

A third-party distribution adds one with an entry point::

    [project.entry-points."gymv.tool_call_formats"]
    my-format = "my_package.fmt:MyFormat"

whose object is a ToolCallFormat subclass (or instance). A built-in name cannot be taken over. A malformed
call still becomes a call (the environment answers it with a tool error the model can learn from).
"""

from __future__ import annotations

import json
import re
from importlib.metadata import entry_points
from typing import Any

from gymv.envs.protocol import ModelTurn, ToolCall
from gymv.errors import GymvError

GROUP = "gymv.tool_call_formats"
DEFAULT = "hermes"

_THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(text without `<think>` blocks, their joined contents or None)."""
    thoughts = [m.group(1).strip() for m in _THINK.finditer(text)]
    return _THINK.sub("", text), "\n".join(t for t in thoughts if t) or None


class ToolCallFormat:
    """Reads a model turn's tool calls out of its text, and writes calls the way a model of this format does
    (used where the chat template does not render a gold turn's calls in this form itself)."""

    name: str = ""

    def parse(self, text: str, call_id_prefix: str = "call") -> ModelTurn:
        raise NotImplementedError

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        """Text of (name, arguments object) calls as the model writes them."""
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
    _NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')

    def _call(self, body: str, call_id: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            # Arguments stay the raw block, so execute() reports the JSON error with the name the model meant.
            m = self._NAME.search(body)
            return ToolCall(m.group(1) if m else "", body, call_id)
        if not isinstance(obj, dict):
            return ToolCall("", body, call_id)
        name = obj.get("name")
        args = obj.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(name if isinstance(name, str) else "", arguments, call_id)

    def parse(self, text: str, call_id_prefix: str = "call") -> ModelTurn:
        text, reasoning = split_reasoning(text)
        calls = [self._call(m.group(1).strip(), f"{call_id_prefix}_{k}") for k, m in enumerate(self._CALL.finditer(text))]
        return ModelTurn(text=self._CALL.sub("", text).strip(), tool_calls=calls, reasoning=reasoning)

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(f'<tool_call>{{"name": {json.dumps(n)}, "arguments": {json.dumps(a, ensure_ascii=False)}}}</tool_call>'
                       for n, a in calls)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3"
    _TAG = "<|python_tag|>"

    def parse(self, text: str, call_id_prefix: str = "call") -> ModelTurn:
        text, reasoning = split_reasoning(text.replace(self._TAG, ""))
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        kept: list[str] = []
        i = 0
        while i < len(text):
            j = text.find("{", i)
            if j < 0:
                kept.append(text[i:])
                break
            try:
                obj, end = decoder.raw_decode(text, j)
            except (json.JSONDecodeError, RecursionError):
                obj, end = None, j + 1
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("parameters" in obj or "arguments" in obj):
                args = obj.get("parameters", obj.get("arguments", {}))
                arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append(ToolCall(obj["name"], arguments, f"{call_id_prefix}_{len(calls)}"))
                kept.append(text[i:j])
                i = end
                while i < len(text) and text[i] in " \t\n;":
                    i += 1
            else:
                kept.append(text[i:end])
                i = end
        return ModelTurn(text="".join(kept).strip(), tool_calls=calls, reasoning=reasoning)

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


BUILTINS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "llama3": Llama3JsonFormat}


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name) if ep.name not in BUILTINS}


def available() -> list[str]:
    return sorted({*BUILTINS, *_plugins()})


def get_tool_call_format(name: str | ToolCallFormat | None) -> ToolCallFormat:
    """The format registered under `name` (None: hermes); an instance passes through."""
    if isinstance(name, ToolCallFormat):
        return name
    name = name or DEFAULT
    if name in BUILTINS:
        return BUILTINS[name]()
    ep = _plugins().get(name)
    if ep is None:
        raise GymvError(f"unknown tool-call format {name!r}", where="rollout.tool_call_format",
                        fix=f"use one of: {', '.join(available())} (plugins register under the entry-point group {GROUP})")
    obj = ep.load()
    fmt = obj() if isinstance(obj, type) else obj
    if not isinstance(fmt, ToolCallFormat):
        raise GymvError(f"tool-call format plugin {name!r} ({ep.value}) is not a ToolCallFormat",
                        fix="point the entry point at a ToolCallFormat subclass")
    return fmt
