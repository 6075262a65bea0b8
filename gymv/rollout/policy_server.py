"""The policy as a Responses-API model server, for agents that run their own episodes (NeMo Gym's agents).

`POST /v1/responses` takes a NeMo Gym request (the conversation so far, tools, sampling parameters; images as
`input_image` data URLs), rebuilds the token sequence exactly as gymv's agent loop would (`agent_turns`: the
tokens of earlier calls are taken from their token fields, never re-tokenized), generates, and answers a
complete Responses-API object whose last output item carries `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` — the fields NeMo Gym's agents pass back on the next call and keep in their results,
from which gymv builds the training sample.

Requests that arrive together are generated together: a collector thread takes what is queued (up to
`max_batch`, waiting at most `batch_wait_s` for more) and makes one `backend.generate` call per set of equal
sampling parameters; with a seed (the step's, set by the agent driver) each batch draws from its own seed
derived from it, as each turn of gymv's loop does. The generation worker hands in its backend behind its
weights lock, so a refit lands between two generate calls and is seen by the next batch only.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from gymv.backends.generation.base import GenerationBackend, GenerationRequest, SamplingParams
from gymv.envs.nemo_schema import ResponseCreateParams, SchemaError, bounded_detail, validate_body
from gymv.envs.responses import new_id, response_object
from gymv import json_bounds
from gymv.errors import GymvError
from gymv.http_serve import BodyError, ListeningServer, OneWriteHandler, json_bytes
from gymv.net import host_allowed, origin_allowed
from gymv.rollout.agent_turns import TurnRebuilder, chat_tools
from gymv.rollout.images import ImageCache
from gymv.rollout.parse import parse_turn
from gymv.rollout.render import ChatRenderer

DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024


@dataclass
class _Job:
    request: GenerationRequest
    params: SamplingParams
    done: Future


class PolicyServer:
    """Serve `backend` on 127.0.0.1 (by default) as a Responses-API model; `start()`/`close()` or a `with`."""

    def __init__(self, backend: GenerationBackend, *, params: SamplingParams, max_seq_len: int,
                 chat_template_kwargs: dict | None = None, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "gymv-policy", max_batch: int = 256, batch_wait_s: float = 0.01,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_image_pixels: int | None = None,
                 tool_call_format: str | None = None):
        self.backend, self.params, self.max_seq_len = backend, params, int(max_seq_len)
        self.model_name, self.max_batch, self.batch_wait_s = model_name, int(max_batch), float(batch_wait_s)
        self.max_body_bytes = int(max_body_bytes)
        self.tool_call_format = tool_call_format  # rollout.tool_call_format: how replies' tool calls are read
        renderer = ChatRenderer(backend.tokenizer, backend.chat_template, chat_template_kwargs,
                                tool_call_format=tool_call_format)
        self.rebuilder = TurnRebuilder(renderer, backend.adapter, ImageCache(max_pixels=max_image_pixels))
        self._rebuild_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.batches: list[int] = []  # requests per generate call, for tests and stats
        handler = type("Handler", (_Handler,), {"server_obj": self})
        try:
            self.httpd = _Server((host, port), handler)
        except OSError as e:
            raise GymvError(f"cannot listen on {host}:{port}: {e.strerror}", fix="pick another port") from None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "PolicyServer":
        for target, name in ((self.httpd.serve_forever, "gymv-policy-http"), (self._collect, "gymv-policy-batch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the endpoint --------------------------------------------------------------------------------
    def respond(self, body: Any) -> dict:
        validate_body(ResponseCreateParams, body)
        items = [{"role": "user", "content": body["input"]}] if isinstance(body["input"], str) else body["input"]
        where = f"model request {new_id('req')}"
        with self._rebuild_lock:  # the image cache is shared
            tools = chat_tools(body.get("tools"))
            seq = self.rebuilder.request_prompt(list(items), tools, where=where)
        room = self.max_seq_len - len(seq.ids)
        if room < 1:
            raise GymvError(f"the conversation has {len(seq.ids)} tokens, leaving no room within max_seq_len "
                            f"{self.max_seq_len}", where=where,
                            fix="raise model.max_seq_len, or end the episode sooner (env.max_turns)")
        params = self._params(body, room)
        job = _Job(GenerationRequest(seq.ids, list(seq.images), where=where), params, Future())
        self._queue.put(job)
        out = job.done.result()
        turn = parse_turn(out.text, f"call_{new_id('c')[2:14]}", self.tool_call_format, tools)
        items_out = turn.to_items()
        last = items_out[-1]
        last.update(prompt_token_ids=list(seq.ids), generation_token_ids=list(out.token_ids),
                    generation_log_probs=[float(x) for x in out.logprobs])
        response = response_object(items_out, params={**body, "model": body.get("model") or self.model_name},
                                   usage={"input_tokens": len(seq.ids), "output_tokens": len(out.token_ids)})
        if out.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        return response

    def _params(self, body: dict, room: int) -> SamplingParams:
        p = self.params
        temperature = body.get("temperature")
        top_p = body.get("top_p")
        cap = body.get("max_output_tokens") or p.max_new_tokens
        out = replace(p, temperature=p.temperature if temperature is None else float(temperature),
                      top_p=p.top_p if top_p is None else float(top_p), max_new_tokens=max(1, min(int(cap), room)))
        out.validate()
        return out

    def _collect(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            try:
                while len(jobs) < self.max_batch:
                    nxt = self._queue.get(timeout=self.batch_wait_s)
                    if nxt is None:
                        self._queue.put(None)
                        break
                    jobs.append(nxt)
            except queue.Empty:
                pass
            groups: dict[SamplingParams, list[_Job]] = {}
            for j in jobs:
                groups.setdefault(replace(j.params, max_new_tokens=0), []).append(j)
            for group in groups.values():
                self._run(group)

    def _run(self, jobs: list[_Job]) -> None:
        params = replace(jobs[0].params, max_new_tokens=max(j.params.max_new_tokens for j in jobs))
        if params.seed is not None:  # every batch its own draw: a seed reused per batch would repeat the noise
            params = replace(params, seed=(params.seed * 1_000_003 + 7_919 * len(self.batches)) % (2**63 - 1))
        try:
            outs = self.backend.generate([j.request for j in jobs], params)
            self.batches.append(len(jobs))
        except BaseException as e:  # every waiting request learns why
            for j in jobs:
                j.done.set_exception(e)
            return
        for j, out in zip(jobs, outs):
            cap = j.params.max_new_tokens
            if len(out.token_ids) > cap:  # a batch-mate needed more room: keep this request's own budget
                text = self.backend.tokenizer.decode(out.token_ids[:cap], skip_special_tokens=True)
                out = replace(out, token_ids=out.token_ids[:cap], logprobs=out.logprobs[:cap], text=text,
                              finish_reason="length")
            j.done.set_result(out)


class _Server(ListeningServer):
    log_name = "gymv model server"


class _Handler(OneWriteHandler):
    server_obj: PolicyServer
    server_version = "gymv-policy"

    def _send(self, status: int, obj: Any) -> None:
        if status >= 400:  # an error answer stays small whatever the body
            obj = {"detail": bounded_detail(obj["detail"])}
        self.send_whole(status, json_bytes(obj), {"Content-Type": "application/json"})

    def do_GET(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] == "/":
            self._send(200, {"status": "ok", "model": self.server_obj.model_name})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        srv = self.server_obj
        bind = self.server.server_address[0]
        if not host_allowed(bind, self.headers.get("Host")) or not origin_allowed(bind, self.headers.get("Origin")):
            self.close_connection = True
            return self._send(403, {"detail": "this model server answers loopback hosts and origins only"})
        if self.path.split("?", 1)[0] != "/v1/responses":
            self.close_connection = True
            return self._send(404, {"detail": "Not Found"})
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0 or length > srv.max_body_bytes:
            self.close_connection = True
            return self._send(413 if length > 0 else 411, {"detail": f"send a Content-Length of at most "
                                                                     f"{srv.max_body_bytes} bytes"})
        try:
            raw = self.read_body()
        except BodyError as e:
            self.close_connection = True
            return self._send(e.status, {"detail": str(e)})
        try:
            body = json_bounds.loads(raw)
            self._send(200, srv.respond(body))
        except json_bounds.NumberTooLong as e:
            self._send(422, {"detail": [{"type": "value_error", "loc": ["body", *e.loc], "msg": str(e), "input": None}]})
        except (ValueError, RecursionError) as e:
            self._send(422, {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": str(e), "input": None}]})
        except SchemaError as e:
            self._send(422, {"detail": e.detail})
        except GymvError as e:
            self._send(400, {"detail": e.one_line()})
        except Exception as e:  # a backend failure: the agent sees a 500 naming it
            sys.stderr.write(f"gymv model server: {type(e).__name__}: {e}\n")
            self._send(500, {"detail": f"{type(e).__name__}: {e}"})
