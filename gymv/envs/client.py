"""A client for NeMo-Gym-style resources servers (`gymv env serve` or NeMo Gym's own).

One client is one rollout session: it keeps the cookies the server sets and sends them back, as NeMo
Gym's agents do, so that stateful tools see the same session from seed_session to verify.
"""

from __future__ import annotations

import http.client
import http.cookiejar
import json
import urllib.error
import urllib.request
from typing import Any

from gymv.envs.nemo_schema import summarize_detail
from gymv.envs.protocol import Image, ToolOutput
from gymv.envs.responses import decode_parts, request_body
from gymv.errors import GymvError


class EnvHTTPError(GymvError):
    """The server answered with an error status; `status` and `detail` say which and why."""

    def __init__(self, status: int, detail: str, url: str):
        super().__init__(f"HTTP {status}: {detail}", where=url, exit_code=1)
        self.status, self.detail = status, detail


class EnvConnectionError(GymvError):
    """The server could not be reached, or the connection broke before a whole answer arrived."""


class EnvClient:
    def __init__(self, base_url: str, *, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.cookies = http.cookiejar.CookieJar()
        self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))

    def _request(self, method: str, path: str, body: Any = None) -> tuple[bytes, Any]:
        url = f"{self.base_url}/{path.lstrip('/')}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                try:
                    return resp.read(), resp.headers
                except (http.client.HTTPException, OSError) as e:  # the server died mid-answer
                    raise EnvConnectionError(f"the connection broke while reading the answer: {type(e).__name__}: {e}",
                                             where=url, exit_code=1) from None
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                detail = summarize_detail(json.loads(raw).get("detail", raw.decode("utf-8", "replace")))
            except (ValueError, AttributeError):
                detail = raw.decode("utf-8", "replace")
            raise EnvHTTPError(e.code, detail, url) from None
        except urllib.error.URLError as e:
            raise EnvConnectionError(f"cannot reach the environment server: {e.reason}", where=url,
                                     fix="start it with `gymv env serve NAME`", exit_code=1) from None
        except (http.client.HTTPException, OSError) as e:  # reset or dropped before the status line
            raise EnvConnectionError(f"the connection to the environment server broke: {type(e).__name__}: {e}",
                                     where=url, fix="check that the server is running", exit_code=1) from None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        raw, _ = self._request(method, path, body)
        return json.loads(raw)

    @property
    def session_id(self) -> str | None:
        return next((c.value for c in self.cookies if c.name == "gymv_session"), None)

    def health(self) -> dict:
        return self._json("GET", "/")

    def seed_session(self, row: dict | None = None) -> dict:
        return self._json("POST", "/seed_session", row or {})

    def call_tool(self, name: str, arguments: dict) -> ToolOutput:
        """A tool's answer; a JSON list of input parts (gymv's image tools) carries images, anything else is text."""
        raw, headers = self._request("POST", f"/{name}", arguments)
        parts = decode_parts(raw.decode("utf-8", "replace"))
        if isinstance(parts, list):
            text = "".join(p.get("text", "") for p in parts if p.get("type") == "input_text")
            images = [Image(p["image_url"], p.get("detail") or "auto") for p in parts if p.get("type") == "input_image"]
            return ToolOutput(text, images)
        return ToolOutput(raw.decode("utf-8"))

    def describe(self) -> dict:
        """gymv servers' GET /describe: name, agent_name, tool schemas, max_turns, endpoints."""
        return self._json("GET", "/describe")

    def reset(self, row: dict) -> dict:
        """Gymnasium-style: start this session's episode; {"observation", "info"}."""
        return self._json("POST", "/reset", row)

    def step(self, row: dict, output: list[dict]) -> dict:
        """Gymnasium-style: one model turn's output items; {"observation", "reward", "terminated", "truncated", "info"}."""
        return self._json("POST", "/step", request_body(row, output))

    def route_exists(self, path: str) -> bool:
        """Whether the server has a POST route at `path`: an empty object is refused (422) where it exists,
        and answered 404/405 where it does not. Used to tell NeMo Gym's server kinds apart."""
        try:
            self._request("POST", path, {})
        except EnvHTTPError as e:
            return e.status not in (404, 405)
        return True

    def verify(self, rollout: dict) -> dict:
        return self._json("POST", "/verify", rollout)

    def aggregate_metrics(self, verify_responses: list[dict]) -> dict:
        return self._json("POST", "/aggregate_metrics", {"verify_responses": verify_responses})
