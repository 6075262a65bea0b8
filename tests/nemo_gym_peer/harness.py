"""Start NeMo Gym's own servers and agents (from the nemo-gym venv) and a scripted model server, on 127.0.0.1.

The model server is the one stand-in: NeMo Gym's agents need a policy behind `/v1/responses`, and the behaviour
under test is the agent <-> environment traffic, so the "model" answers each row with turns the test chose
(the environment's gold answer, or a wrong or malformed one). Its answers are built by
`gymv.envs.responses.response_object`, so NeMo Gym's agents validating them also checks that builder.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gymv.envs.protocol import ModelTurn
from gymv.envs.responses import response_object

HERE = Path(__file__).parent
REPO = HERE.parent.parent

RESOURCES = {
    "circle_count": "resources_servers.circle_count.app:CircleCountResourcesServer",
    "circle_click": "resources_servers.circle_click.app:CircleClickResourcesServer",
    "example_multi_turn_gymnasium": "resources_servers.example_multi_turn_gymnasium.app:ExampleMultiTurnEnv",
}
AGENTS = {
    "simple_agent": "responses_api_agents.simple_agent.app:SimpleAgent",
    "gymnasium_agent": "responses_api_agents.gymnasium_agent.app:GymnasiumAgent",
}


def nemo_gym_python() -> str | None:
    """The nemo-gym venv's python (made on first use by scripts/nemo_gym_venv.sh); None without Python 3.12."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "nemo_gym_venv.sh")], capture_output=True, text=True)
    if proc.returncode == 3:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/nemo_gym_venv.sh failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class NemoGymProcess:
    """One NeMo Gym server or agent in its own process; `url` once `ready()` returned."""

    def __init__(self, python: str, name: str, cls: str, *, config: dict | None = None,
                 servers: dict[str, str] | None = None, port: int | None = None):
        self.name, self.port = name, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        peers = {k: ["127.0.0.1", int(v.rsplit(":", 1)[1])] for k, v in (servers or {}).items()}
        peers[name] = ["127.0.0.1", self.port]
        spec = {"name": name, "class": cls, "port": self.port, "config": config or {}, "servers": peers}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        self.proc = subprocess.Popen([python, str(HERE / "serve.py"), json.dumps(spec)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._out: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._out.append(line)

    def ready(self, timeout_s: float = 120.0) -> "NemoGymProcess":
        deadline = time.monotonic() + timeout_s
        while not _alive(self.url):
            if self.proc.poll() is not None:
                raise RuntimeError(f"NeMo Gym server {self.name} exited:\n{''.join(self._out)[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"NeMo Gym server {self.name} not up after {timeout_s} s:\n{''.join(self._out)[-3000:]}")
            time.sleep(0.2)
        return self

    def output(self) -> str:
        return "".join(self._out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prompt_key(input_items) -> str:
    """Which row a model request is for: the hash of its first user message (text and image)."""
    if isinstance(input_items, str):
        first = input_items
    else:
        first = next((i.get("content") for i in input_items if isinstance(i, dict) and i.get("role") == "user"), "")
    return hashlib.sha256(json.dumps(first, sort_keys=True).encode()).hexdigest()


def _model_turns_so_far(input_items) -> int:
    """How many model responses the conversation already holds (runs of assistant/function_call items)."""
    count, previous = 0, False
    for item in input_items if isinstance(input_items, list) else []:
        kind = item.get("type", "message")
        model = kind in ("function_call", "reasoning") or (kind == "message" and item.get("role") == "assistant")
        if model and not previous:
            count += 1
        previous = model
    return count


class ScriptedModel:
    """A Responses-API model server whose answers per row are scripted: `script[prompt_key] = [ModelTurn, ...]`."""

    def __init__(self):
        self.script: dict[str, list[ModelTurn]] = {}
        self.requests: list[dict] = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append(body)
                turns = model.script.get(prompt_key(body["input"]), [ModelTurn(text="no script for this row")])
                k = min(_model_turns_so_far(body["input"]), len(turns) - 1)
                raw = json.dumps(response_object(turns[k].to_items(), params=body,
                                                 usage={"input_tokens": 7, "output_tokens": 3})).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, row: dict, turns: list[ModelTurn]) -> None:
        self.script[prompt_key(row["responses_create_params"]["input"])] = turns

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def post_json(url: str, body, timeout: float = 60.0) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode("utf-8", "replace")


def start_all(starters: list[Callable[[], NemoGymProcess]]) -> list[NemoGymProcess]:
    """Start several servers at once (each takes seconds to import) and wait until all answer."""
    procs = [s() for s in starters]
    try:
        for p in procs:
            p.ready()
    except Exception:
        for p in procs:
            p.stop()
        raise
    return procs
