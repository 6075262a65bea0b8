"""How a model writes tool calls in its text: a registry of formats (`rollout.tool_call_format`).

Built-ins:
- ``hermes``: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3 and the
  tiny models); `<think>...</think>` is reasoning.
- ``llama3``: a bare JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2/3.3 JSON tool calling),
  optionally after `<|python_tag|>`; several calls may follow one another, `;`-separated or not.
- ``qwen3_coder``: XML calls, `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n
  </tool_call>` (Nemotron 3 and its Omni, Qwen3-Coder), read as vLLM's `qwen3_coder` tool parser reads them:
  a value is typed by the tool's JSON schema, so this format parses with the turn's tool schemas.

A third-party distribution adds one with an entry point::

    [project.entry-points."gymv.tool_call_formats"]
    my-format = "my_package.fmt:MyFormat"

whose object is a ToolCallFormat subclass (or instance); in-process code calls `TOOL_CALL_FORMATS.register`
(a `gymv.registry.Registry`). A built-in name cannot be taken over. A malformed
call still becomes a call (the environment answers it with a tool error the model can learn from), except where
the format's reference parser gives up on the whole turn (qwen3_coder, as vLLM's): the text is then a plain
message with no call.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from gymv.envs.protocol import ModelTurn, ToolCall
from gymv.errors import GymvError
from gymv.registry import Registry, import_path

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
    # True: `parse` takes the turn's tool schemas (keyword `tools`, chat-template form) to type the arguments
    needs_tools: bool = False

    def parse(self, text: str, call_id_prefix: str = "call") -> ModelTurn:
        raise NotImplementedError

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        """Text of (name, arguments object) calls as the model writes them."""
        raise NotImplementedError

    def write_turn(self, content: str, calls: list[tuple[str, Any]]) -> str:
        """An assistant turn's text: its content, then its calls, laid out as this format's templates do."""
        return content + self.write_calls(calls)

    def write_tools(self, tools: list[dict]) -> str | None:
        """The tool declarations this format's templates put in the system message, for a chat template that
        declares tools in another form; None: the chat template's own declarations stand."""
        return None

    def declares(self, rendered: str, tools: list[dict]) -> bool:
        """Whether a chat template's rendering already declares `tools` in this format's form."""
        return True


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


class _Unparsable(Exception):
    """The whole turn is left as text, as vLLM's qwen3_coder parser leaves it when reading it fails."""


def _function(tool: Any) -> dict:
    return tool["function"] if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool


def _properties(name: str, tools: list[dict] | None) -> Any:
    """The argument schemas vLLM's parser types a call's values by: the first function tool of that name's
    `parameters.properties` (its `parameters` where it has no properties; {} where there is no such tool)."""
    for tool in tools or []:
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)):
            continue
        if tool["function"].get("name") == name:
            params = tool["function"].get("parameters")
            if isinstance(params, dict):
                return params["properties"] if "properties" in params else params
            return {}
    return {}


def _typed(value: str, name: str, props: dict) -> Any:
    """A parameter's text as vLLM's qwen3_coder parser types it: `null` is None; a parameter the schema does
    not list stays text; otherwise by the schema's `type` (str() of it, lower-cased; text when it has none).
    A value that does not convert stays text (a boolean that is not true is false); a number too large for
    an int (inf) fails the whole turn, as in vLLM."""
    if value.lower() == "null":
        return None
    if name not in props:
        return value
    spec = props[name]
    kind = str(spec["type"]).strip().lower() if isinstance(spec, dict) and "type" in spec else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        try:
            return int(number) if number == int(number) else number
        except ValueError:  # nan
            return value
        except OverflowError:  # inf: vLLM's parser gives up on the turn
            raise _Unparsable from None
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:  # json.JSONDecodeError included; a RecursionError fails the turn
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError):
        return value
    except RecursionError:
        raise _Unparsable from None


def _template_value(value: Any) -> str:
    """A value as the Nemotron and Qwen3-Coder templates write it: JSON for objects and arrays, else str()."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)


def _extra_keys(obj: Any, handled: tuple[str, ...]) -> str:
    if not isinstance(obj, dict):
        return ""
    return "".join(f"\n<{k}>{_template_value(v)}</{k}>" for k, v in obj.items() if k not in handled)


class Qwen3CoderFormat(ToolCallFormat):
    """XML tool calls (Nemotron 3 and Nemotron 3 Omni, Qwen3-Coder), read as vLLM 0.11's `qwen3_coder` tool
    parser reads them (NeMo RL's `tool_parser: qwen3_coder`):

    - the turn holds calls only where `<function=` appears; the calls are the `<function=...>` blocks inside
      the `<tool_call>` blocks (the whole text when there are none), a block left unclosed runs to the end;
    - a block's name is the text up to its first `>`; its parameters are `<parameter=KEY>VALUE` runs, each
      ended by `</parameter>`, the next `<parameter=`, `</function>` or the end; one newline is trimmed
      from each end of a value, which is then typed by the tool's schema (`_typed`);
    - the turn's text is what precedes the first `<tool_call>` (else the first `<function=`); text after
      the calls is dropped;
    - where reading fails (a name or parameter without `>`, a value that breaks the conversion), the turn has
      no call and its whole text is a plain message: the episode then ends as a turn without a call does.

    A call naming an unknown tool, lacking a parameter or carrying an untyped value is still a call, as in
    vLLM; the environment answers it with a tool error. Writing follows the Nemotron 3 chat template.
    """

    name = "qwen3_coder"
    needs_tools = True
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    _FUNCTION = re.compile(r"<function=(?:(.*?)</function>|(.*)\Z)", re.S)
    _PARAMETER = re.compile(r"<parameter=(.*?)(?=</parameter>|<parameter=|</function>|$)(?:</parameter>)?", re.S)

    def _bodies(self, text: str) -> list[str]:
        blocks = self._BLOCK.findall(text) or [text]
        return [m.group(1) if m.group(1) is not None else m.group(2)
                for block in blocks for m in self._FUNCTION.finditer(block)]

    def _call(self, body: str, tools: list[dict] | None, call_id: str) -> ToolCall:
        name, sep, rest = body.partition(">")
        if not sep:
            raise _Unparsable
        props = _properties(name, tools)
        if not isinstance(props, dict):  # a schema whose properties are no mapping: vLLM's lookup fails the turn
            raise _Unparsable
        args: dict[str, Any] = {}
        for raw in self._PARAMETER.findall(rest):
            key, sep, value = raw.partition(">")
            if not sep:
                raise _Unparsable
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, key, props)
        try:
            return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id)
        except (TypeError, ValueError):  # a set, bytes or complex from literal_eval: vLLM fails the turn too
            raise _Unparsable from None

    def parse(self, text: str, call_id_prefix: str = "call", tools: list[dict] | None = None) -> ModelTurn:
        text, reasoning = split_reasoning(text)
        if "<function=" not in text:
            return ModelTurn(text=text.strip(), reasoning=reasoning)
        try:
            calls = [self._call(b, tools, f"{call_id_prefix}_{k}") for k, b in enumerate(self._bodies(text))]
        except _Unparsable:
            calls = []
        if not calls:
            return ModelTurn(text=text.strip(), reasoning=reasoning)
        start = text.find("<tool_call>")
        start = start if start >= 0 else text.find("<function=")
        return ModelTurn(text=text[:start].strip(), tool_calls=calls, reasoning=reasoning)

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            params = "".join(f"<parameter={k}>\n{_template_value(v)}\n</parameter>\n"
                             for k, v in (args.items() if isinstance(args, dict) else ()))
            out.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>\n")
        return "".join(out)

    def write_turn(self, content: str, calls: list[tuple[str, Any]]) -> str:
        content = content.strip()
        return (content + "\n" if content else "") + self.write_calls(calls)

    def write_tools(self, tools: list[dict]) -> str:
        """The Nemotron 3 template's layout of the declarations (functions, parameters with their type,
        description and other schema keys, the required list), with gymv's own instructions."""
        out = ["# Tools\n\nThese functions can be called:\n\n<tools>"]
        for tool in map(_function, tools):
            out.append(f"\n<function>\n<name>{tool.get('name', '')}</name>")
            if "description" in tool:
                out.append(f"\n<description>{str(tool['description']).strip()}</description>")
            out.append("\n<parameters>")
            params = tool.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            for pname, fields in (props.items() if isinstance(props, dict) else ()):
                fields = fields if isinstance(fields, dict) else {}
                out.append(f"\n<parameter>\n<name>{pname}</name>")
                if "type" in fields:
                    out.append(f"\n<type>{fields['type']}</type>")
                if "description" in fields:
                    out.append(f"\n<description>{str(fields['description']).strip()}</description>")
                if "enum" in fields:
                    out.append(f"\n<enum>{json.dumps(fields['enum'], ensure_ascii=False)}</enum>")
                out.append(_extra_keys(fields, ("name", "type", "description", "enum")) + "\n</parameter>")
            out.append(_extra_keys(params, ("type", "properties", "required")))
            if isinstance(params, dict) and "required" in params:
                out.append(f"\n<required>{json.dumps(params['required'], ensure_ascii=False)}</required>")
            out.append("\n</parameters>" + _extra_keys(tool, ("type", "name", "description", "parameters"))
                       + "\n</function>")
        out.append("\n</tools>\n\nTo call a function, answer with blocks of this form and write nothing after them:"
                   "\n\n<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n"
                   "</tool_call>\n\nGive each required argument in a <parameter=...> block of its own; a value may "
                   "span several lines. Any reasoning comes before the first block.")
        return "".join(out)

    def declares(self, rendered: str, tools: list[dict]) -> bool:
        return all(f"<function>\n<name>{_function(t).get('name', '')}</name>" in rendered for t in tools)


TOOL_CALL_FORMATS = Registry("tool-call format", GROUP, {
    "hermes": import_path(HermesFormat),
    "llama3": import_path(Llama3JsonFormat),
    "qwen3_coder": import_path(Qwen3CoderFormat),
}, where="rollout.tool_call_format")


def available() -> list[str]:
    return list(TOOL_CALL_FORMATS.available())


def get_tool_call_format(name: str | ToolCallFormat | None) -> ToolCallFormat:
    """The format registered under `name` (None: hermes); an instance passes through."""
    if isinstance(name, ToolCallFormat):
        return name
    name = name or DEFAULT
    obj = TOOL_CALL_FORMATS.load(name)
    fmt = obj() if isinstance(obj, type) else obj
    if not isinstance(fmt, ToolCallFormat):
        raise GymvError(f"tool-call format {name!r} is not a ToolCallFormat (got {type(fmt).__name__})",
                        where="rollout.tool_call_format", fix="point the entry point at a ToolCallFormat subclass")
    return fmt
