"""Rows and rollouts in NeMo Gym's format: reading their messages, tools and model output.

A row is ``{"responses_create_params": {"input": [...], "tools": [...]}, <verifier fields>, "agent_ref": {...}}``;
a rollout adds ``response`` (whose ``output`` holds message, function_call, function_call_output and
reasoning items) and ``reward``. Errors name the row and the JSON path so that a bad file is easy to fix.
"""

from __future__ import annotations

from typing import Any

from gymv.data.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, decode_data_url, split_data_url
from gymv.envs.messages import Image, Message, Part, RowError, Text

ROLES = ("system", "developer", "user", "assistant")


def _at(where: str | None, path: str) -> str:
    return f"{where}: {path}" if where else path


def row_input(row: dict, *, where: str | None = None) -> list:
    """The `responses_create_params.input` items; a plain string input is one user message."""
    rcp = row.get("responses_create_params")
    if not isinstance(rcp, dict):
        raise RowError("row has no 'responses_create_params' object", where=where,
                       fix="write rows in NeMo Gym's format (see `gymv prepare`)")
    items = rcp.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RowError("'responses_create_params.input' must be a non-empty list of messages", where=where,
                       fix="give responses_create_params.input as a list of {role, content} messages")
    return items


def _parse_part(part: object, path: str, where: str | None) -> Part:
    if not isinstance(part, dict):
        raise RowError(f"{path} must be an object, got {type(part).__name__}", where=where,
                       fix='write each content part as an object such as {"type": "input_text", "text": ...}')
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise RowError(f"{path}.text must be a string", where=where, fix="write the part's text as a string")
        return Text(text)
    if kind in ("input_image", "image_url"):
        url = part.get("image_url")
        if isinstance(url, dict):  # chat-completions style {"image_url": {"url": ...}}
            url = url.get("url")
        split_data_url(url, where=_at(where, f"{path}.image_url"))
        return Image(url, part.get("detail") or "auto")
    raise RowError(f"{path} has unsupported content type {kind!r}", where=where,
                   fix="use input_text and input_image parts")


def parse_message(item: object, path: str = "message", *, where: str | None = None) -> Message:
    """A Responses-API message item (string or list content) as a Message."""
    if not isinstance(item, dict):
        raise RowError(f"{path} must be an object, got {type(item).__name__}", where=where,
                       fix='write each input item as an object such as {"role": "user", "content": ...}')
    if item.get("type", "message") != "message":
        raise RowError(f"{path} is a {item.get('type')!r} item, not a message", where=where,
                       fix="put only messages in responses_create_params.input")
    role = item.get("role")
    if role not in ROLES:
        raise RowError(f"{path}.role must be one of {', '.join(ROLES)}, got {role!r}", where=where,
                       fix="use one of those roles")
    content = item.get("content")
    if isinstance(content, str):
        return Message(role, [Text(content)])
    if not isinstance(content, list):
        raise RowError(f"{path}.content must be a string or a list of parts", where=where,
                       fix="write content as text or a list of input_text and input_image parts")
    return Message(role, [_parse_part(p, f"{path}.content[{k}]", where) for k, p in enumerate(content)])


def input_messages(row: dict, *, where: str | None = None) -> list[Message]:
    """The row's prompt messages; every image must be an image data URL (checked, not yet decoded)."""
    items = row_input(row, where=where)
    return [parse_message(item, f"responses_create_params.input[{j}]", where=where) for j, item in enumerate(items)]


def check_images(row: dict, *, where: str | None = None, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Decode every prompt image with the safety limits; returns how many there are."""
    n = 0
    for j, msg in enumerate(input_messages(row, where=where)):
        for k, part in enumerate(msg.content):
            if isinstance(part, Image):
                decode_data_url(part.url, max_pixels=max_pixels, max_bytes=max_bytes,
                                where=_at(where, f"responses_create_params.input[{j}].content[{k}]"))
                n += 1
    return n


def row_tools(row: dict) -> list[dict]:
    rcp = row.get("responses_create_params")
    tools = rcp.get("tools") if isinstance(rcp, dict) else None
    return tools if isinstance(tools, list) else []


def to_chat_tool(tool: dict) -> dict:
    """A Responses-API function tool in the nested chat-completions form that chat templates expect."""
    if "function" in tool:
        return tool
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def last_user_text(row: dict) -> str:
    """The text of the last user message of the prompt (the question, for previews)."""
    for item in reversed(row_input(row)):
        if isinstance(item, dict) and item.get("role") == "user":
            return parse_message(item).text
    return ""


def response_output(rollout: dict, *, where: str | None = None) -> list[dict]:
    """The `response.output` items of a rollout or verify request."""
    response = rollout.get("response")
    if not isinstance(response, dict):
        raise RowError("rollout has no 'response' object", where=where,
                       fix="pass rollouts that include the model response (NeMo Gym rollout format)")
    output = response.get("output")
    if not isinstance(output, list):
        raise RowError("'response.output' must be a list of output items", where=where,
                       fix="write response.output as a list of Responses-API output items")
    return output


def output_text(output: list[Any]) -> str:
    """All assistant output_text, concatenated: what NeMo Gym's `response.output_text` gives a verifier."""
    texts = []
    for item in output:
        if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
    return "".join(texts)


def function_calls(output: list[Any], name: str | None = None) -> list[dict]:
    """The function_call items of an output, optionally only those calling `name`, in order."""
    return [item for item in output if isinstance(item, dict) and item.get("type") == "function_call"
            and (name is None or item.get("name") == name)]


def agent_name(row: Any) -> str | None:
    """The row's `agent_ref.name` (the NeMo Gym agent that serves it), or None when it has none; the one
    place that reads it."""
    ref = row.get("agent_ref") if isinstance(row, dict) else None
    name = ref.get("name") if isinstance(ref, dict) else None
    return name if isinstance(name, str) and name else None


def answer_int(digits: str, max_digits: int = 30) -> int | None:
    """int() of a number the model wrote (`[-+]?digits`), or None when it has more significant digits than
    any answer here can have: Python's int() refuses over 4,300 digits, and a model can write a million."""
    if len(digits.lstrip("+-").lstrip("0")) > max_digits:
        return None
    try:
        return int(digits)
    except ValueError:  # digits str.isdigit() accepts and int() does not ("²")
        return None
