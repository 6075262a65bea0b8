"""The environment protocol: what the agent loop, the HTTP server and `gymv env verify` rely on.

An environment turns a data row into the first messages of an episode (text and images, plus tool
schemas), reacts to each model turn (tool results that may carry images, scripted follow-up user
messages, a done flag), and scores the finished transcript. Single-turn environments are the multi-turn
case with ``max_turns = 1``.

The transcript is kept as OpenAI Responses-API output items, the same shape NeMo Gym writes into rollout
files and sends to ``/verify``, so that scoring an in-process episode, an HTTP verify request and a
recorded rollout is one code path (:meth:`Environment.score_output`).
"""

from __future__ import annotations

import json
import random
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gymv.envs.messages import Image, Message, Part, RowError, Text, parts_to_items  # noqa: F401  (part of the protocol)
from gymv.envs.rows import input_messages, response_output
from gymv.envs.schema import SchemaError, validate_arguments
from gymv.errors import GymvError

# ------------------------------------------------------------------------------------------- model turns


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model produced it; `arguments` is the raw JSON text, validated only when run."""

    name: str
    arguments: str
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")

    def to_item(self) -> dict:
        return {"type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": "completed"}


@dataclass
class ModelTurn:
    """One model response: its visible text, tool calls and optional reasoning."""

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None

    def to_items(self) -> list[dict]:
        items: list[dict] = []
        if self.reasoning:
            items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": self.reasoning}]})
        if self.text or not self.tool_calls:
            items.append({"type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": self.text, "annotations": []}]})
        items.extend(c.to_item() for c in self.tool_calls)
        return items

    def as_text(self) -> str:
        """A readable one-line rendering (previews, logs); chat templates render tool calls themselves."""
        calls = " ".join(f"{c.name}({c.arguments})" for c in self.tool_calls)
        return " ".join(s for s in (self.text, calls) if s)


@dataclass
class ToolOutput:
    """What a tool handler returns: text and, unlike NeMo Gym 0.4 tools, optionally images."""

    text: str = ""
    images: list[Image] = field(default_factory=list)


@dataclass
class ToolResult:
    call_id: str
    name: str
    text: str
    images: list[Image] = field(default_factory=list)
    error: str | None = None

    def to_item(self) -> dict:
        """A function_call_output item; with images its output is a list of input parts (Responses API)."""
        if self.images:
            parts: list[Part] = ([Text(self.text)] if self.text else []) + list(self.images)
            output: str | list = parts_to_items(parts)
        else:
            output = self.text
        return {"type": "function_call_output", "call_id": self.call_id, "output": output}


@dataclass
class StepResult:
    tool_results: list[ToolResult] = field(default_factory=list)
    user_messages: list[Message] = field(default_factory=list)
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class Score:
    """A reward with the verifier's extras; `failure_reason` names why the reward is not full (model faults)."""

    reward: float
    extras: dict = field(default_factory=dict)
    failure_reason: str | None = None


@dataclass
class EpisodeState:
    """One rollout in progress: the row, the transcript so far (Responses output items) and env state."""

    row: dict
    messages: list[Message]
    output: list[dict] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    """A tool: its JSON schema (what the model sees) and the handler that runs a validated call."""

    name: str
    description: str
    parameters: dict
    handler: Callable[[EpisodeState | None, dict], "ToolOutput | str"]
    strict: bool = True

    def schema(self) -> dict:
        """The function-tool format of NeMo Gym rows (Responses API: flat, not nested under 'function')."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


@dataclass(frozen=True)
class NoKnobs:
    """Environments that do not generate data have no knobs."""


# ------------------------------------------------------------------------------------------ environment


class Environment(ABC):
    """Base class of every environment; subclasses set the class attributes and implement the hooks.

    Built-ins live in gymv/envs; third-party ones register through the entry-point group ``gymv.envs``.
    """

    name: ClassVar[str]
    agent_name: ClassVar[str]  # NeMo Gym agent that serves these rows (agent_ref.name)
    verifier_fields: ClassVar[tuple[str, ...]] = ()
    max_turns: ClassVar[int] = 1
    Knobs: ClassVar[type] = NoKnobs
    presets: ClassVar[dict[str, Any]] = {"default": NoKnobs()}
    description: ClassVar[str] = ""
    # Its calls wait on I/O (a server) and may be made from several threads at once: the agent loop then
    # starts, steps and scores the episodes of a batch concurrently instead of one after another.
    concurrent_calls: ClassVar[bool] = False

    def __init__(self, *, max_turns: int | None = None):
        if max_turns is not None:
            if max_turns < 1:
                raise GymvError(f"max_turns must be at least 1, got {max_turns}", fix="set max_turns to 1 or more")
            self.max_turns = max_turns

    # -- tools ---------------------------------------------------------------------------------------
    def tool_specs(self) -> list[Tool]:
        return []

    def tools(self) -> list[dict]:
        """Tool schemas in the OpenAI function-tool format of NeMo Gym rows."""
        return [t.schema() for t in self.tool_specs()]

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tool_specs() if t.name == name), None)

    def run_tool(self, state: EpisodeState | None, name: str, arguments: object) -> ToolOutput:
        """Validate `arguments` (already parsed JSON) against the tool's schema and run it.

        Raises ToolCallError for an unknown tool or arguments that do not match the schema; the message is
        written for the model to read.
        """
        tool = self.tool(name)
        if tool is None:
            known = ", ".join(t.name for t in self.tool_specs()) or "none"
            raise ToolCallError(f"unknown tool {name!r} (available: {known})", status=404)
        try:
            args = validate_arguments(arguments, tool.parameters)
        except SchemaError as e:
            raise ToolCallError(f"{name}: {e}", status=422) from None
        out = tool.handler(state, args)
        return out if isinstance(out, ToolOutput) else ToolOutput(text=str(out))

    def execute(self, state: EpisodeState | None, call: ToolCall) -> ToolResult:
        """Run one model tool call; bad JSON, unknown tools and wrong argument types become error results."""
        try:
            args = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        except (json.JSONDecodeError, RecursionError) as e:
            msg = f"{call.name}: arguments are not valid JSON ({e})"
            return ToolResult(call.call_id, call.name, json.dumps({"error": msg}), error=msg)
        try:
            out = self.run_tool(state, call.name, args)
        except ToolCallError as e:
            return ToolResult(call.call_id, call.name, json.dumps({"error": e.message}), error=e.message)
        return ToolResult(call.call_id, call.name, out.text, list(out.images))

    # -- episode -------------------------------------------------------------------------------------
    def check_row(self, row: object, *, where: str | None = None) -> dict:
        """Check the verifier fields of a row; raise RowError naming the field. Returns the row."""
        if not isinstance(row, dict):
            raise RowError(f"a row must be a JSON object, got {type(row).__name__}", where=where,
                           fix="write one JSON object per line")
        for key in self.verifier_fields:
            if key not in row:
                raise RowError(f"row is missing the verifier field {key!r} that {self.name} needs", where=where,
                               fix=f"generate rows with `gymv prepare {self.name}` or pass the source rows with --data")
        return row

    def initial_messages(self, row: dict, *, where: str | None = None) -> list[Message]:
        return input_messages(row, where=where)

    def start(self, row: dict, *, where: str | None = None) -> EpisodeState:
        self.check_row(row, where=where)
        return EpisodeState(row=row, messages=self.initial_messages(row, where=where))

    def step(self, state: EpisodeState, turn: ModelTurn) -> StepResult:
        """Record the model turn, run its tool calls, add scripted follow-ups, decide whether the episode ends."""
        if state.done:
            raise GymvError(f"{self.name}: step() called on a finished episode", fix="start a new episode")
        state.turns += 1
        state.output.extend(turn.to_items())
        results = [self.execute(state, call) for call in turn.tool_calls]
        state.output.extend(r.to_item() for r in results)
        follow_ups = self.follow_up(state, turn, results)
        state.output.extend({"type": "message", **m.to_item()} for m in follow_ups)
        state.done = self.is_done(state, turn, results, follow_ups)
        return StepResult(tool_results=results, user_messages=follow_ups, done=state.done)

    def follow_up(self, state: EpisodeState, turn: ModelTurn, results: list[ToolResult]) -> list[Message]:
        """Scripted user messages after a turn (none by default)."""
        return []

    def is_done(self, state: EpisodeState, turn: ModelTurn, results: list[ToolResult], follow_ups: list[Message]) -> bool:
        return state.turns >= self.max_turns or (not turn.tool_calls and not follow_ups)

    # -- scoring -------------------------------------------------------------------------------------
    def score(self, state: EpisodeState) -> Score:
        return self.score_output(state.row, state.output)

    @abstractmethod
    def score_output(self, row: dict, output: list[dict]) -> Score:
        """Score Responses output items against the row's verifier fields (NeMo Gym's reward rule)."""

    def verify(self, body: object, *, where: str | None = None) -> dict:
        """NeMo Gym's /verify: a row plus `response` in; the same with `reward` and the verifier extras out."""
        row = self.check_row(body, where=where)
        output = response_output(row, where=where)
        s = self.score_output(row, output)
        return {**row, "reward": s.reward, **s.extras, "failure_reason": s.failure_reason}

    # -- data ----------------------------------------------------------------------------------------
    @abstractmethod
    def gold_turn(self, row: dict) -> ModelTurn:
        """The assistant turn that earns full reward (the SFT warm start trains on it)."""

    def gold_turns(self, row: dict) -> list[ModelTurn]:
        """Every assistant turn of a full-reward episode, in order; stepping them through `step` from `start`
        ends the episode with reward 1. Single-turn environments need not override it."""
        return [self.gold_turn(row)]

    def gold_answer(self, row: dict) -> str:
        return " | ".join(t.as_text() for t in self.gold_turns(row))

    def check_knobs(self, knobs: Any) -> None:
        """Raise GymvError when knobs cannot produce valid rows."""

    def make_row(self, rng: random.Random, knobs: Any, index: int) -> dict:
        """One data row from its own RNG; must depend on nothing else, so that generation parallelises."""
        raise GymvError(f"environment {self.name!r} does not generate data",
                        fix="use an environment with a generator (see gymv prepare --help), or pass data.train rows")

    def matches(self, row: dict) -> bool:
        """Whether a row without agent_ref looks like this environment's (used to pick a verifier)."""
        return all(k in row for k in self.verifier_fields) if self.verifier_fields else False


class ToolCallError(GymvError):
    """A tool call the environment refuses (unknown tool, wrong arguments); the message is for the model."""

    def __init__(self, message: str, *, status: int = 422):
        super().__init__(message)
        self.status = status
