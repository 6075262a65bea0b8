"""The request bodies NeMo Gym's servers accept, as pydantic models, so `gymv env serve` accepts the same ones.

A body NeMo Gym would refuse is refused here with the same status (422) and the same error-body shape
(`{"detail": [{"type", "loc", "msg", "input"}, ...]}`, `loc` starting with "body"), so that a client written
against `gymv env serve` also works against NeMo Gym's servers, and the other way round. The models follow
nemo-gym 0.4.0: `responses_create_params` forbids unknown keys, `response` is a complete Responses-API object,
output items are validated by their `type`, and a function_call_output's `output` is a string. Where NeMo
Gym's models allow keys beside their fields (a row's, an item's), these ignore them: a body is validated and
dropped, and ignoring accepts the same bodies without copying each of a row's keys.

An error answer stays small whatever the body (FastAPI's grows with it: each error echoes its `input`, and a
body of a million bad items is a million errors). Validation stops at the first bad item of each list (the
rest of a list is not validated once one item failed), a mapping with more unknown or non-string entries than
are listed is counted without pydantic (which would keep an error for each), at most `MAX_LISTED` errors are
listed and then one `too_many_errors` entry that counts the rest, and each error's `input` is echoed whole only
when it is small (a string of at most `ECHO_CHARS` characters, another value whose JSON text is at most that
long): a larger one is the start of the string or of the JSON text, cut with "…".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Iterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, FailFast, Field, Tag, ValidationError

MAX_LISTED = 20  # errors listed in one answer
ECHO_CHARS = 200  # an error's `input`, as JSON text
TEXT_CHARS = 1000  # a message
LOC_KEY_CHARS = 64  # a key in an error's `loc`
MAX_LOC = 16  # entries of a `loc`


class _FailFast(FailFast):
    """pydantic's FailFast, hashable so that it can sit in a Union's member."""

    __hash__ = object.__hash__


def _List(item: Any) -> Any:
    """A list whose validation stops at its first bad item."""
    return Annotated[list[item], _FailFast()]


Status = Literal["in_progress", "completed", "incomplete"]


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputText(BaseModel):
    type: Literal["input_text"]
    text: str


class InputImage(BaseModel):
    type: Literal["input_image"]
    detail: Literal["low", "high", "auto"] = "auto"
    image_url: str | None = None
    file_id: str | None = None


class InputFile(BaseModel):
    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None


InputPart = Annotated[Union[InputText, InputImage, InputFile], Field(discriminator="type")]


class EasyInputMessage(_Item):
    content: Union[str, _List(InputPart)]
    role: Literal["user", "assistant", "system", "developer"]
    type: Literal["message"] = "message"


class OutputMessage(_Item):
    id: str
    content: _List(dict[str, Any])
    role: Literal["assistant"] = "assistant"
    status: Status = "completed"
    type: Literal["message"] = "message"


class FunctionCall(_Item):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: Status | None = None


class FunctionCallOutput(_Item):
    call_id: str
    output: str
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: Status | None = None


class Reasoning(_Item):
    id: str
    summary: _List(dict[str, Any])
    type: Literal["reasoning"] = "reasoning"
    encrypted_content: str | None = None


def _item_kind(value: Any) -> str:
    if not isinstance(value, dict):
        return "message_in"
    kind = value.get("type", "message")
    if kind == "message":
        return "message_out" if "id" in value and value.get("role") == "assistant" else "message_in"
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message_in"


Item = Annotated[Union[
    Annotated[EasyInputMessage, Tag("message_in")],
    Annotated[OutputMessage, Tag("message_out")],
    Annotated[FunctionCall, Tag("function_call")],
    Annotated[FunctionCallOutput, Tag("function_call_output")],
    Annotated[Reasoning, Tag("reasoning")],
], Discriminator(_item_kind)]


class ResponseCreateParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    background: bool | None = None
    include: _List(str) | None = None
    input: Union[str, _List(Item)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    store: bool | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any]] = "auto"
    tools: _List(dict[str, Any]) = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    stream: Literal[False] | None = None


class _TokenDetailsIn(BaseModel):
    cached_tokens: int


class _TokenDetailsOut(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: _TokenDetailsIn
    output_tokens: int
    output_tokens_details: _TokenDetailsOut
    total_tokens: int


class Response(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    created_at: float
    model: str
    object: Literal["response"]
    output: _List(Item)
    parallel_tool_calls: bool
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any]]
    tools: _List(dict[str, Any])
    usage: Usage | None = None


class RunRequest(BaseModel):
    """`/reset` (and an agent's `/run`): a row; fields beside `responses_create_params` pass through."""

    model_config = ConfigDict(extra="ignore")
    responses_create_params: ResponseCreateParams


class VerifyRequest(RunRequest):
    """`/verify` and `/step`: the row plus the model's complete `response`."""

    response: Response


class SchemaError(Exception):
    """A body NeMo Gym would refuse; `detail` is FastAPI's list of errors."""

    def __init__(self, detail: list[dict]):
        super().__init__(detail[0]["msg"] if detail else "invalid body")
        self.detail = detail


def validate_body(model: type[BaseModel], body: Any) -> None:
    """Raise SchemaError with FastAPI's error list, bounded, when NeMo Gym's models would refuse `body`."""
    _count_mapping_errors(model, body)
    try:
        model.model_validate(body)
    except ValidationError as e:
        detail = [{"type": err["type"], "loc": ["body", *err["loc"]], "msg": err["msg"], "input": err.get("input")}
                  for err in e.errors(include_url=False, include_context=False)]
        raise SchemaError(bounded_detail(detail)) from None


def _count_mapping_errors(model: type[BaseModel], body: Any) -> None:
    """pydantic keeps an error for every unknown key of `responses_create_params` and every `metadata` value
    that is not a string, however many (a million keys: gigabytes held, tens of seconds). Past MAX_LISTED of
    them they are counted here, and the errors listed from here, without pydantic."""
    if model is ResponseCreateParams:
        params, loc = body, ["body"]
    elif issubclass(model, RunRequest) and isinstance(body, dict):
        params, loc = body.get("responses_create_params"), ["body", "responses_create_params"]
    else:
        return
    if not isinstance(params, dict):
        return
    fields = ResponseCreateParams.model_fields
    extra = [k for k in params if k not in fields]
    metadata = params.get("metadata")
    not_text = [k for k, v in metadata.items() if not isinstance(v, str)] if isinstance(metadata, dict) else []
    if len(extra) + len(not_text) <= MAX_LISTED + 1:
        return
    detail = [{"type": "extra_forbidden", "loc": [*loc, k], "msg": "Extra inputs are not permitted",
               "input": params[k]} for k in extra[:MAX_LISTED]]
    detail += [{"type": "string_type", "loc": [*loc, "metadata", k], "msg": "Input should be a valid string",
                "input": metadata[k]} for k in not_text[:MAX_LISTED - len(detail)]]
    raise SchemaError(bounded_detail(detail, total=len(extra) + len(not_text)))


def bounded_detail(detail: Any, total: int | None = None) -> Any:
    """An error answer's `detail` of bounded size: a message cut at TEXT_CHARS; of a list of errors (`total`
    of them in all, the list's length unless given) at most MAX_LISTED + 1, else the first MAX_LISTED and a
    `too_many_errors` entry counting the rest, each with its texts cut and its `input` echoed by `echo`.
    Bounding a bounded detail leaves it as it is."""
    if isinstance(detail, str):
        return _clip(detail, TEXT_CHARS)
    if not isinstance(detail, list):
        return detail
    total = len(detail) if total is None else total
    listed = detail if total <= MAX_LISTED + 1 else detail[:MAX_LISTED]
    out = [_bounded_error(err) for err in listed]
    if total > len(out):
        out.append({"type": "too_many_errors", "loc": ["body"], "msg": f"{total - len(out)} more errors not listed",
                    "input": None})
    return out


def _bounded_error(err: Any) -> Any:
    if not isinstance(err, dict):
        return _clip(str(err), TEXT_CHARS)
    out = dict(err)
    if isinstance(err.get("loc"), list):
        loc = [_clip(p, LOC_KEY_CHARS) if isinstance(p, str) else p for p in err["loc"][:MAX_LOC]]
        out["loc"] = loc + ["…"] if len(err["loc"]) > MAX_LOC else loc
    if isinstance(err.get("msg"), str):
        out["msg"] = _clip(err["msg"], TEXT_CHARS)
    if "input" in err:
        out["input"] = echo(err["input"])
    return out


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def echo(value: Any, limit: int = ECHO_CHARS) -> Any:
    """`value` itself when small: a string of at most `limit` characters, another value whose JSON text is at
    most that long. Else the start of the string or of the JSON text, cut with "…" (echoing that gives it
    back). Only that start is ever encoded, so a value of any size costs the same."""
    if isinstance(value, str):
        return _clip(value, limit)
    text = ""
    for piece in _json_pieces(value, limit):
        text += piece
        if len(text) > limit:
            return text[:limit] + "…"
    return value


def _json_pieces(value: Any, limit: int) -> Iterator[str]:
    if isinstance(value, str):
        yield json.dumps(value[:limit + 1], ensure_ascii=False)
    elif isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _json_pieces(str(k), limit)
            yield ": "
            yield from _json_pieces(v, limit)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, v in enumerate(value):
            yield ", " if i else ""
            yield from _json_pieces(v, limit)
        yield "]"
    elif value is None or isinstance(value, (bool, int, float)):
        yield json.dumps(value)
    else:
        yield json.dumps(repr(value)[:limit + 1])


def summarize_detail(detail: Any, limit: int = 3) -> str:
    """A FastAPI/NeMo Gym error list as one readable line ('body.response.id: Field required; ...')."""
    if not isinstance(detail, list):
        return str(detail)
    lines = []
    for err in detail[:limit]:
        if isinstance(err, dict):
            loc = ".".join(str(p) for p in err.get("loc", []))
            lines.append(f"{loc}: {err.get('msg', '?')}" if loc else str(err.get("msg", "?")))
        else:
            lines.append(str(err))
    more = f" (+{len(detail) - limit} more)" if len(detail) > limit else ""
    return "; ".join(lines) + more
