"""The request bodies NeMo Gym's servers accept, as pydantic models, so `gymv env serve` accepts the same ones.

A body NeMo Gym would refuse is refused here with the same status (422) and the same error-body shape
(`{"detail": [{"type", "loc", "msg", "input"}, ...]}`, `loc` starting with "body"), so that a client written
against `gymv env serve` also works against NeMo Gym's servers, and the other way round. The models follow
nemo-gym 0.4.0: `responses_create_params` forbids unknown keys, `response` is a complete Responses-API object,
output items are validated by their `type`, and a function_call_output's `output` is a string.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

Status = Literal["in_progress", "completed", "incomplete"]


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


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
    content: Union[str, list[InputPart]]
    role: Literal["user", "assistant", "system", "developer"]
    type: Literal["message"] = "message"


class OutputMessage(_Item):
    id: str
    content: list[dict[str, Any]]
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
    summary: list[dict[str, Any]]
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
    include: list[str] | None = None
    input: Union[str, list[Item]]
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
    tools: list[dict[str, Any]] = Field(default_factory=list)
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
    model_config = ConfigDict(extra="allow")

    id: str
    created_at: float
    model: str
    object: Literal["response"]
    output: list[Item]
    parallel_tool_calls: bool
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any]]
    tools: list[dict[str, Any]]
    usage: Usage | None = None


class RunRequest(BaseModel):
    """`/reset` (and an agent's `/run`): a row; fields beside `responses_create_params` pass through."""

    model_config = ConfigDict(extra="allow")
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
    """Raise SchemaError with FastAPI's error list when NeMo Gym's models would refuse `body`."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        detail = [{"type": err["type"], "loc": ["body", *err["loc"]], "msg": err["msg"], "input": err.get("input")}
                  for err in e.errors(include_url=False, include_context=False)]
        raise SchemaError(detail) from None


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
