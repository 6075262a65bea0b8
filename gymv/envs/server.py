"""Serve an environment over HTTP with NeMo Gym's resources-server endpoints.

    GET  /                   liveness: {"status": "ok", ...}
    POST /seed_session       start a rollout's session (optionally with its row, for stateful tools)
    POST /<tool>             run a tool; the body is the tool's JSON arguments
    POST /verify             a row plus `response` in; the same plus `reward` and verifier extras out
    POST /aggregate_metrics  {"verify_responses": [...]} in; mean/max/min/median/std out
    POST /reset              gymnasium style: a row in; the session holds its episode; {"observation", "info"} out
    POST /step               gymnasium style: the row plus `response` (one model turn) in;
                             {"observation", "reward", "terminated", "truncated", "info"} out
    GET  /describe           the environment: name, agent name, tool schemas, max_turns, endpoints

Each rollout is a session keyed by the `gymv_session` cookie, set on every response, which NeMo Gym's
agents pass back. Requests are validated as NeMo Gym's servers validate them (`gymv.envs.nemo_schema`):
a body NeMo Gym refuses is a 422 whose `detail` is FastAPI's list of errors, bounded in size whatever the body
(`nemo_schema.bounded_detail`); a body over the size limit is a 413, an unknown path a 404. A tool that
returns images answers with the JSON text of a list of Responses input parts (and the header
`X-Gymv-Tool-Output: parts`); a text result is the plain body, as NeMo Gym's tools answer.

`/step` answers as NeMo Gym's gymnasium servers do, with strings where NeMo Gym's agents need strings: the
next user message as `observation`, `info.tool_outputs` with one `{call_id, name, output}` per tool call
(`output` is the text, or the JSON text of its parts when it has images), per-step `reward` (the episode's
reward on its last step, else 0), and `terminated` (the environment ended the episode) or `truncated` (its
`max_turns` did). gymv also puts the follow-ups, lossless, in `info.user_messages`, and the verifier's
extras and `failure_reason` in `info` on the last step. An episode whose step raised is dropped: a retry
gets 409, never a half-applied turn.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from http.cookies import CookieError, SimpleCookie
from typing import Any

from gymv.envs.nemo_schema import RunRequest, SchemaError, VerifyRequest, bounded_detail, validate_body
from gymv.envs.protocol import Environment, EpisodeState, Text, ToolCallError, parts_to_items
from gymv.envs.responses import encode_parts
from gymv.envs.transcript import turn_from_items
from gymv.envs.verify import aggregate_metrics
from gymv import json_bounds
from gymv.errors import GymvError
from gymv.http_serve import DEFAULT_READ_DEADLINE_S, BodyError, ListeningServer, OneWriteHandler, json_bytes
from gymv.net import host_allowed, origin_allowed

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SESSION_BYTES = 1024 * 1024 * 1024
SESSION_COOKIE = "gymv_session"
RESERVED = frozenset({"seed_session", "verify", "aggregate_metrics", "reset", "step"})


class HTTPError(Exception):
    """An error answer; a 422's `detail` is FastAPI's list of errors, as NeMo Gym's servers answer."""

    def __init__(self, status: int, detail: str | list):
        if status == 422 and isinstance(detail, str):
            detail = [{"type": "value_error", "loc": ["body"], "msg": detail, "input": None}]
        super().__init__(detail if isinstance(detail, str) else detail[0]["msg"])
        self.status, self.detail = status, detail


def _validate(model, body: Any) -> None:
    try:
        validate_body(model, body)
    except SchemaError as e:
        raise HTTPError(422, e.detail) from None


class _Sessions:
    """Per-rollout state, bounded in count and in bytes (each episode counted at the size of the row that
    started it): the least recently used session goes first, and a later call on it gets a 409."""

    def __init__(self, limit: int, max_bytes: int):
        self.limit, self.max_bytes = limit, max_bytes
        self._items: OrderedDict[str, tuple[EpisodeState | None, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def touch(self, sid: str | None) -> str:
        with self._lock:
            if sid is None or sid not in self._items:
                sid = uuid.uuid4().hex
                self._items[sid] = (None, 0)
            self._items.move_to_end(sid)
            self._evict()
            return sid

    def _evict(self) -> None:
        while len(self._items) > self.limit or (self.bytes > self.max_bytes and len(self._items) > 1):
            _, (_, nbytes) = self._items.popitem(last=False)
            self.bytes -= nbytes

    def get(self, sid: str) -> EpisodeState | None:
        with self._lock:
            return self._items.get(sid, (None, 0))[0]

    def set(self, sid: str, state: EpisodeState | None, nbytes: int = 0) -> None:
        with self._lock:
            _, old = self._items.get(sid, (None, 0))
            self._items[sid] = (state, nbytes if state is not None else 0)
            self.bytes += self._items[sid][1] - old
            self._items.move_to_end(sid)
            self._evict()

    def __len__(self) -> int:
        return len(self._items)


class _ListeningServer(ListeningServer):
    log_name = "gymv env serve"


class EnvServer:
    """A threaded HTTP server for one environment; `start()` serves in the background, `close()` stops."""

    def __init__(self, env: Environment, host: str = "127.0.0.1", port: int = 0, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_sessions: int = 10_000,
                 max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES, request_timeout: float = 60.0,
                 read_deadline: float = DEFAULT_READ_DEADLINE_S, log_requests: bool = False, step_latency_s: float = 0.0):
        if step_latency_s < 0:
            raise GymvError(f"step latency must be >= 0 seconds, got {step_latency_s}",
                            fix="give a latency of 0 or more seconds")
        clash = RESERVED.intersection(t.name for t in env.tool_specs())
        if clash:
            raise GymvError(f"environment {env.name!r} has a tool named like an endpoint: {sorted(clash)[0]}",
                            fix="rename the tool")
        self.env = env
        self.max_body_bytes = max_body_bytes
        self.sessions = _Sessions(max_sessions, max_session_bytes)
        self.log_requests = log_requests
        self.step_latency_s = float(step_latency_s)  # added to every /step and tool call: a slow tool, simulated
        handler = type("Handler", (_Handler,), {"server_obj": self, "idle_timeout_s": request_timeout,
                                                "read_deadline_s": read_deadline})
        try:
            self.httpd = _ListeningServer((host, port), handler)
        except OSError as e:
            raise GymvError(f"cannot listen on {host}:{port}: {e.strerror}", fix="pick another --port") from None
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.05)

    def start(self) -> "EnvServer":
        self._thread = threading.Thread(target=self.serve_forever, name=f"gymv-env-{self.env.name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> "EnvServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- endpoints -----------------------------------------------------------------------------------
    def liveness(self) -> dict:
        return {"status": "ok", "env": self.env.name, "tools": [t.name for t in self.env.tool_specs()]}

    def describe(self) -> dict:
        env = self.env
        return {"name": env.name, "agent_name": env.agent_name, "description": env.description,
                "max_turns": env.max_turns, "verifier_fields": list(env.verifier_fields), "tools": env.tools(),
                "endpoints": ["/seed_session", "/reset", "/step", "/verify", "/aggregate_metrics",
                              *(f"/{t.name}" for t in env.tool_specs())]}

    def reset(self, sid: str, body: Any, nbytes: int = 0) -> dict:
        if not isinstance(body, dict):
            raise HTTPError(422, f"reset body must be a JSON object (a row), got {_kind(body)}")
        _validate(RunRequest, body)
        try:
            self.sessions.set(sid, self.env.start(body, where="reset body"), nbytes)
        except GymvError as e:
            raise HTTPError(422, e.one_line()) from None
        return {"observation": None, "info": {"env": self.env.name, "max_turns": self.env.max_turns}}

    def step(self, sid: str, body: Any) -> dict:
        env = self.env
        if not isinstance(body, dict):
            raise HTTPError(422, f"step body must be a row plus 'response' (one model turn), got {_kind(body)}")
        _validate(VerifyRequest, body)
        response = body["response"]
        state = self.sessions.get(sid)
        if state is None:
            raise HTTPError(409, "no episode in this session: POST /reset with the row first (or the episode "
                                 "was dropped after a failed step)")
        if state.done:
            raise HTTPError(409, "the episode in this session is over; POST /reset to start another")
        turn = turn_from_items(response["output"])
        self._wait()
        try:
            result = env.step(state, turn)
            natural = env.is_done(dataclasses.replace(state, turns=0), turn, result.tool_results,
                                  result.user_messages)
            score = env.score(state) if state.done else None
        except GymvError as e:
            self.sessions.set(sid, None)
            raise HTTPError(422, e.one_line()) from None
        except Exception:
            self.sessions.set(sid, None)
            raise
        tool_outputs = []
        for r in result.tool_results:
            output = r.to_item()["output"]
            out = {"call_id": r.call_id, "name": r.name,
                   "output": output if isinstance(output, str) else encode_parts(output)}
            if r.error:
                out["error"] = r.error
            tool_outputs.append(out)
        messages = [{"type": "message", **m.to_item()} for m in result.user_messages]
        info: dict[str, Any] = {"tool_outputs": tool_outputs, "user_messages": messages, "turn": state.turns}
        if score is not None:
            info.update(extras=score.extras, failure_reason=score.failure_reason)
        return {"observation": _observation(result.user_messages), "reward": score.reward if score else 0.0,
                "terminated": state.done and natural, "truncated": state.done and not natural, "info": info}

    def seed_session(self, sid: str, body: Any, nbytes: int = 0) -> dict:
        if not isinstance(body, dict):
            raise HTTPError(422, f"seed_session body must be a JSON object, got {_kind(body)}")
        if any(k in body for k in ("responses_create_params", *self.env.verifier_fields)):
            try:
                self.sessions.set(sid, self.env.start(body, where="seed_session body"), nbytes)
            except GymvError as e:
                raise HTTPError(422, e.one_line()) from None
        return {}

    def verify(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise HTTPError(422, f"verify body must be a JSON object (a row plus 'response'), got {_kind(body)}")
        _validate(VerifyRequest, body)
        try:
            return self.env.verify(body, where="verify body")
        except GymvError as e:
            raise HTTPError(422, e.one_line()) from None

    def aggregate(self, body: Any) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("verify_responses"), list):
            raise HTTPError(422, "aggregate_metrics body must be {\"verify_responses\": [...]}")
        try:
            return aggregate_metrics(body["verify_responses"])
        except GymvError as e:
            raise HTTPError(422, e.one_line()) from None

    def _wait(self) -> None:
        if self.step_latency_s:
            time.sleep(self.step_latency_s)

    def tool(self, sid: str, name: str, body: Any) -> tuple[bytes, dict[str, str]]:
        self._wait()
        try:
            out = self.env.run_tool(self.sessions.get(sid), name, body)
        except ToolCallError as e:
            raise HTTPError(e.status, e.message) from None
        if out.images:
            parts = parts_to_items(([Text(out.text)] if out.text else []) + list(out.images))
            return json.dumps(parts).encode(), {"Content-Type": "application/json", "X-Gymv-Tool-Output": "parts"}
        ctype = "application/json" if _is_json(out.text) else "text/plain; charset=utf-8"
        return out.text.encode("utf-8"), {"Content-Type": ctype}


def _observation(messages: list) -> str | None:
    """NeMo Gym's `observation` (a string): the follow-up text, or the encoded input parts when it has images."""
    if not messages:
        return None
    if all(not m.images for m in messages):
        return "\n\n".join(m.text for m in messages)
    return encode_parts([part for m in messages for part in parts_to_items(m.content)])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


class _Handler(OneWriteHandler):
    server_obj: EnvServer
    server_version = "gymv-env"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        if self.server_obj.log_requests:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    # -- plumbing ------------------------------------------------------------------------------------
    def _session_id(self) -> str | None:
        raw = self.headers.get("Cookie")
        if not raw:
            return None
        try:
            cookie = SimpleCookie(raw)
        except CookieError:
            return None
        morsel = cookie.get(SESSION_COOKIE)
        return morsel.value if morsel else None

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, *, sid: str | None = None,
              close: bool = False) -> None:
        headers = {"Content-Type": "application/json", **(headers or {})}
        if sid is not None:
            headers["Set-Cookie"] = f"{SESSION_COOKIE}={sid}; Path=/; HttpOnly; SameSite=Lax"
        self.send_whole(status, body, headers, close=close)

    def _json(self, status: int, obj: Any, *, sid: str | None = None, close: bool = False) -> None:
        self._send(status, json_bytes(obj), sid=sid, close=close)

    def _error(self, status: int, detail: str | list, *, sid: str | None = None, close: bool = False) -> None:
        self._json(status, {"detail": bounded_detail(detail)}, sid=sid, close=close)

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding") is not None:
            raise HTTPError(411, "chunked request bodies are not supported; send a Content-Length")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise HTTPError(411, "a POST body needs a Content-Length header")
        length = int(length_text)  # h11 has read it as digits only, and one value
        limit = self.server_obj.max_body_bytes
        if length > limit:
            raise HTTPError(413, f"request body of {length} bytes is over the {limit} byte limit")
        try:
            raw = self.read_body()
        except BodyError as e:
            raise HTTPError(e.status, str(e)) from None
        self._body_bytes = len(raw)
        if not raw or raw.isspace():
            raise HTTPError(422, [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
        try:
            return json_bounds.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise HTTPError(400, "request body is not UTF-8") from None
        except json_bounds.NumberTooLong as e:
            raise HTTPError(422, [{"type": "value_error", "loc": ["body", *e.loc], "msg": str(e), "input": None}]) from None
        except json.JSONDecodeError as e:
            raise HTTPError(422, [{"type": "json_invalid", "loc": ["body", e.pos], "msg": "JSON decode error",
                                   "input": {}, "ctx": {"error": f"{e.msg} at line {e.lineno} column {e.colno}"}}]) from None
        except RecursionError:
            raise HTTPError(400, "malformed JSON body: nested too deeply") from None

    # -- methods -------------------------------------------------------------------------------------
    def _refused(self) -> bool:
        """Requests a loopback server must not serve: another Host name, or a page of another origin."""
        bind = self.server_obj.host
        if not host_allowed(bind, self.headers.get("Host")):
            self._error(403, f"Host {self.headers.get('Host')!r} is not allowed: this server answers loopback "
                             "names only (serve with --host to answer others)", close=True)
            return True
        if not origin_allowed(bind, self.headers.get("Origin")):
            self._error(403, f"requests from pages of {self.headers.get('Origin')!r} are not allowed", close=True)
            return True
        return False

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's naming
        if self._refused():
            return
        sid = self.server_obj.sessions.touch(self._session_id())
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._json(200, self.server_obj.liveness(), sid=sid)
        elif path == "/describe":
            self._json(200, self.server_obj.describe(), sid=sid)
        else:
            self._error(404, f"no GET endpoint {self.path}; GET / is the liveness check", sid=sid)

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        if self._refused():
            return
        srv = self.server_obj
        sid = srv.sessions.touch(self._session_id())
        name = self.path.split("?", 1)[0].strip("/")
        try:
            if name not in RESERVED and srv.env.tool(name) is None:
                tools = ", ".join(t.name for t in srv.env.tool_specs()) or "none"
                # The body is left unread: close so that it cannot be taken for the next request.
                raise HTTPError(404, f"unknown endpoint /{name}: tools are {tools}; endpoints are "
                                     "/seed_session, /verify, /aggregate_metrics, /reset, /step")
            body = self._read_json()
            if name == "seed_session":
                self._json(200, srv.seed_session(sid, body, self._body_bytes), sid=sid)
            elif name == "verify":
                self._json(200, srv.verify(body), sid=sid)
            elif name == "aggregate_metrics":
                self._json(200, srv.aggregate(body), sid=sid)
            elif name == "reset":
                self._json(200, srv.reset(sid, body, self._body_bytes), sid=sid)
            elif name == "step":
                self._json(200, srv.step(sid, body), sid=sid)
            else:
                payload, headers = srv.tool(sid, name, body)
                self._send(200, payload, headers, sid=sid)
        except HTTPError as e:
            self._error(e.status, e.detail, sid=sid, close=e.status in (400, 404, 408, 411, 413))
        except Exception as e:  # an environment bug must not take the server down
            traceback.print_exc(file=sys.stderr)
            self._error(500, f"internal error in {srv.env.name}: {type(e).__name__}: {e}", sid=sid, close=True)

    def _not_allowed(self) -> None:
        self._error(405, f"method {self.command} is not allowed; use GET / or POST", close=True)

    do_PUT = do_DELETE = do_PATCH = _not_allowed
