"""An environment that runs in another process: a `gymv env serve` server or a NeMo Gym server, over HTTP.

`RemoteEnv` is an ordinary `Environment` to the rollout loop. Each episode is its own server session (the
session cookie is kept per episode). Two protocols:

- ``gymnasium`` (`gymv env serve`, NeMo Gym's gymnasium servers): `POST /reset` with the row starts the
  episode; every model turn goes to `POST /step`, whose answer carries the tool results (text and
  images, images as data URLs), the next user message and, on the last step, the reward.
- ``resources`` (NeMo Gym's resources servers such as circle_click): `POST /seed_session` with the row,
  one `POST /<tool>` per tool call, and the episode ends like a local one (a turn without tool calls, or
  `max_turns`).

The reward of an episode the server ended is the sum of its step rewards (NeMo Gym's); any other
episode is scored by `POST /verify` with the transcript, except on NeMo Gym's gymnasium servers, which have no
`/verify`: an episode gymv's `max_turns` cut short scores the sum of its step rewards, as NeMo Gym's
`gymnasium_agent` scores one. ``auto`` picks ``gymnasium`` for servers that answer `GET /describe` (gymv's)
or have a `POST /reset` route (NeMo Gym's gymnasium servers), and ``resources`` for servers with
`POST /seed_session` (NeMo Gym's resources servers). Every body gymv sends is a complete NeMo Gym request:
the row plus a full Responses-API `response` (`gymv.envs.responses`).

Faults: a connection error or a 5xx answer is retried `retries` times with exponential backoff, within
`timeout_s` x (retries + 1) in all (gymv.envs.retry); after
that the call raises `RemoteEnvError`, which the rollout loop turns into that trajectory's `error`
(excluded from training and counted) while the rest of the batch goes on. A 422 on reset or verify is
the row's fault (`RowError`, like a local environment); an unknown tool or arguments the server refuses
come back to the model as tool-error results; a lost session (409) is a `RemoteEnvError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from gymv.envs.client import EnvClient, EnvConnectionError, EnvHTTPError
from gymv.envs.protocol import (Environment, EpisodeState, Image, Message, ModelTurn, RowError, Score, StepResult,
                                Text, ToolResult)
from gymv.envs.registry import get_env
from gymv.envs.responses import decode_parts, request_body
from gymv.envs.retry import Backoff
from gymv.errors import GymvError

T = TypeVar("T")
PROTOCOLS = ("auto", "gymnasium", "resources")
_MODEL_FAULTS = (400, 404, 422)  # a tool call the server refuses: the model reads why


class RemoteEnvError(GymvError):
    """An environment server stayed unreachable or failing after bounded retries (infrastructure, not data)."""


def _parts(content: Any) -> list:
    """Responses input parts (or a plain string, or the JSON text of a parts list) as gymv content parts."""
    content = decode_parts(content)
    if isinstance(content, str):
        return [Text(content)]
    out: list = []
    for p in content if isinstance(content, list) else []:
        if not isinstance(p, dict):
            continue
        if p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            out.append(Text(p["text"]))
        elif p.get("type") in ("input_image", "image_url"):
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str):
                out.append(Image(url, p.get("detail") or "auto"))
    return out


class RemoteEnv(Environment):
    name = "remote"
    agent_name = "remote"
    concurrent_calls = True  # one client per episode; a server call is I/O wait

    def __init__(self, url: str, *, name: str | None = None, protocol: str = "auto", max_turns: int | None = None,
                 timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.25, agent_name: str | None = None):
        super().__init__(max_turns=max_turns)
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise GymvError(f"env.url {url!r} is not an http(s) URL", where="env.url",
                            fix="write it like http://127.0.0.1:8000")
        if protocol not in PROTOCOLS:
            raise GymvError(f"unknown remote protocol {protocol!r}", fix=f"use one of: {', '.join(PROTOCOLS)}")
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise GymvError("retries must be >= 0, timeout_s > 0 and backoff_s >= 0",
                            fix="set env.retries >= 0 and env.timeout_s > 0")
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        info = self._describe()
        local = _local_env(name or (info or {}).get("name"))
        self.name = (info or {}).get("name") or name or parsed.netloc
        self.agent_name = agent_name or (info or {}).get("agent_name") or (local.agent_name if local else self.name)
        self.description = f"{self.name} served at {self.url}"
        self.verifier_fields = tuple((info or {}).get("verifier_fields") or (local.verifier_fields if local else ()))
        self._tools = list((info or {}).get("tools") or (local.tools() if local else []))
        self._local = local
        if max_turns is None:
            self.max_turns = int((info or {}).get("max_turns") or (local.max_turns if local else 1))
        self.protocol = protocol if protocol != "auto" else self._detect_protocol(info)
        # NeMo Gym's gymnasium servers have no /verify: an episode they did not end scores its step rewards.
        self._has_verify = self.protocol == "resources" or "/verify" in ((info or {}).get("endpoints") or [])

    def _detect_protocol(self, info: dict | None) -> str:
        """gymv's servers describe themselves; NeMo Gym's are told apart by the routes they have."""
        if info is not None:
            return "gymnasium"
        client = self._client()
        if self._call("probe POST /reset", lambda: client.route_exists("/reset")):
            return "gymnasium"
        if self._call("probe POST /seed_session", lambda: client.route_exists("/seed_session")):
            return "resources"
        raise RemoteEnvError("the server has neither /reset (a gymnasium server) nor /seed_session (a resources "
                             "server)", where=self.url,
                             fix="point env.url at a NeMo Gym resources or gymnasium server, or `gymv env serve`")

    # -- plumbing ------------------------------------------------------------------------------------
    def _client(self) -> EnvClient:
        return EnvClient(self.url, timeout=self.timeout_s)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one request; retry connection errors and 5xx answers with backoff, then RemoteEnvError."""
        last: GymvError | None = None
        tries = Backoff(self.retries, self.backoff_s, self.timeout_s * (self.retries + 1))
        for _ in tries:
            try:
                return fn()
            except EnvConnectionError as e:
                last = e
            except EnvHTTPError as e:
                if e.status < 500 and last is None:
                    raise
                if e.status < 500:  # e.g. 409 after a 500: the server dropped the episode that failed
                    raise RemoteEnvError(f"{what} failed: {last.message}; its retry answered HTTP {e.status}: "
                                         f"{e.detail}", where=self.url, exit_code=1) from None
                last = e
        n = tries.attempts
        raise RemoteEnvError(f"{what} failed after {n} attempt{'s' if n != 1 else ''}: {last.message}", where=self.url,
                             fix="check the environment server (is it running? its log?)", exit_code=1)

    def _describe(self) -> dict | None:
        try:
            info = self._call("GET /describe", lambda: self._client().describe())
        except EnvHTTPError:
            return None  # not a gymv server (NeMo Gym's have no /describe)
        except RemoteEnvError as e:
            raise RemoteEnvError(f"cannot reach the environment server: {e.message}", where=self.url,
                                 fix="start it with `gymv env serve NAME --port PORT` or correct env.url") from None
        return info if isinstance(info, dict) else None

    def tools(self) -> list[dict]:
        return list(self._tools)

    # -- episode -------------------------------------------------------------------------------------
    def start(self, row: dict, *, where: str | None = None) -> EpisodeState:
        self.check_row(row, where=where)
        client = self._client()
        endpoint = "/reset" if self.protocol == "gymnasium" else "/seed_session"
        try:
            if self.protocol == "gymnasium":
                answer = self._call("POST /reset", lambda: client.reset(row))
            else:
                answer = self._call("POST /seed_session", lambda: client.seed_session(row))
        except EnvHTTPError as e:
            if e.status == 422:
                raise RowError(f"the environment server refused the row: {e.detail}", where=where,
                               fix="fix the row as the server's message says, or drop it") from None
            other = "resources" if self.protocol == "gymnasium" else "gymnasium"
            raise RemoteEnvError(f"POST {endpoint} answered HTTP {e.status}: {e.detail}", where=self.url,
                                 fix=f"this server has no {endpoint}: set env.kwargs.protocol: {other} (or auto)"
                                 if e.status in (404, 405) else None, exit_code=1) from None
        messages = self.initial_messages(row, where=where)
        observation = answer.get("observation") if isinstance(answer, dict) else None
        if observation:
            messages.append(Message("user", _parts(observation)))
        return EpisodeState(row=row, messages=messages,
                            data={"client": client, "rewards": [], "ended": False, "info": {}})

    def step(self, state: EpisodeState, turn: ModelTurn) -> StepResult:
        if state.done:
            raise GymvError(f"{self.name}: step() called on a finished episode", fix="start a new episode")
        state.turns += 1
        items = turn.to_items()
        state.output.extend(items)
        if self.protocol == "gymnasium":
            results, follow_ups = self._step_gymnasium(state, turn, items)
        else:
            results = [self._run_tool(state, call) for call in turn.tool_calls]
            follow_ups = []
            state.done = state.turns >= self.max_turns or not turn.tool_calls
        state.output.extend(r.to_item() for r in results)
        state.output.extend({"type": "message", **m.to_item()} for m in follow_ups)
        if state.turns >= self.max_turns:
            state.done = True
        return StepResult(tool_results=results, user_messages=follow_ups, done=state.done)

    def _step_gymnasium(self, state: EpisodeState, turn: ModelTurn, items: list[dict]):
        client: EnvClient = state.data["client"]
        try:
            answer = self._call("POST /step", lambda: client.step(state.row, items))
        except EnvHTTPError as e:
            raise RemoteEnvError(f"POST /step answered HTTP {e.status}: {e.detail}", where=self.url,
                                 exit_code=1) from None
        if not isinstance(answer, dict):
            raise RemoteEnvError("POST /step did not answer a JSON object", where=self.url, exit_code=1)
        info = answer.get("info") if isinstance(answer.get("info"), dict) else {}
        names = {c.call_id: c.name for c in turn.tool_calls}
        results = []
        for out in info.get("tool_outputs") or []:
            if not isinstance(out, dict):
                continue
            call_id = str(out.get("call_id", ""))
            parts = _parts(out.get("output", ""))
            text = "".join(p.text for p in parts if isinstance(p, Text))
            results.append(ToolResult(call_id, str(out.get("name") or names.get(call_id, "")), text,
                                      [p for p in parts if isinstance(p, Image)], error=out.get("error")))
        if isinstance(info.get("user_messages"), list):
            follow_ups = [Message("user", _parts(m.get("content"))) for m in info["user_messages"] if isinstance(m, dict)]
        elif answer.get("observation"):
            follow_ups = [Message("user", _parts(answer["observation"]))]
        else:
            follow_ups = []
        reward = answer.get("reward", 0.0)
        state.data["rewards"].append(float(reward) if isinstance(reward, (int, float)) else 0.0)
        if answer.get("terminated") or answer.get("truncated"):
            state.data["ended"], state.data["info"] = True, info
            state.done = True
        return results, follow_ups

    def _run_tool(self, state: EpisodeState, call) -> ToolResult:
        try:
            args = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        except (json.JSONDecodeError, RecursionError) as e:
            msg = f"{call.name}: arguments are not valid JSON ({e})"
            return ToolResult(call.call_id, call.name, json.dumps({"error": msg}), error=msg)
        client: EnvClient = state.data["client"]
        try:
            out = self._call(f"POST /{call.name}", lambda: client.call_tool(call.name, args))
        except EnvHTTPError as e:
            if e.status not in _MODEL_FAULTS:
                raise RemoteEnvError(f"POST /{call.name} answered HTTP {e.status}: {e.detail}", where=self.url,
                                     exit_code=1) from None
            return ToolResult(call.call_id, call.name, json.dumps({"error": e.detail}), error=e.detail)
        return ToolResult(call.call_id, call.name, out.text, list(out.images))

    # -- scoring -------------------------------------------------------------------------------------
    def score(self, state: EpisodeState) -> Score:
        if state.data.get("ended"):
            info = state.data["info"]
            extras = info.get("extras") if isinstance(info.get("extras"), dict) else {}
            return Score(sum(state.data["rewards"]), dict(extras), info.get("failure_reason"))
        if self.protocol == "gymnasium" and not self._has_verify:
            # As NeMo Gym's gymnasium_agent scores an episode that ran out of steps: truncated, its rewards so far.
            return Score(sum(state.data["rewards"]), {}, None)
        return self.score_output(state.row, state.output)

    def score_output(self, row: dict, output: list[dict]) -> Score:
        if not self._has_verify:
            raise RemoteEnvError("this gymnasium server has no /verify to score a transcript", where=self.url,
                                 fix="score episodes by running them (NeMo Gym's gymnasium servers reward in /step)")
        body = request_body(row, output)
        try:
            answer = self._call("POST /verify", lambda: self._client().verify(body))
        except EnvHTTPError as e:
            if e.status == 422:
                raise RowError(f"the environment server cannot score the row: {e.detail}",
                               fix="fix the row as the server's message says, or drop it") from None
            raise RemoteEnvError(f"POST /verify answered HTTP {e.status}: {e.detail}", where=self.url,
                                 exit_code=1) from None
        reward = answer.get("reward") if isinstance(answer, dict) else None
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise RemoteEnvError("POST /verify answered without a numeric 'reward'", where=self.url, exit_code=1)
        extras = {k: v for k, v in answer.items() if k not in body and k not in ("reward", "failure_reason")}
        return Score(float(reward), extras, answer.get("failure_reason"))

    # -- data ----------------------------------------------------------------------------------------
    def gold_turns(self, row: dict) -> list[ModelTurn]:
        return self._require_local().gold_turns(row)

    def gold_turn(self, row: dict) -> ModelTurn:
        return self._require_local().gold_turn(row)

    def _require_local(self) -> Environment:
        if self._local is None:
            raise GymvError(f"the remote environment {self.name!r} has no local copy to give gold answers",
                            fix="install the environment locally, or train SFT on rows with their own answers")
        return self._local


def _local_env(name: str | None) -> Environment | None:
    """The installed environment of that name (for agent name, tools and gold answers), if there is one."""
    if not name:
        return None

    try:
        return get_env(name)
    except GymvError:
        return None
