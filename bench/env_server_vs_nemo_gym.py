"""Benchmark: gymv's HTTP servers against NeMo Gym 0.4.0's own, side by side in one run, under an agent's traffic.

Environment server: `gymv env serve circle-count` against NeMo Gym's circle_count resources server (its FastAPI
app under uvicorn, run from the nemo-gym Python 3.12 venv that scripts/nemo_gym_venv.sh makes, as the interop
tests run it). Both get the same NeMo-shaped `POST /verify` body: a default circle-count row (1000x1000 image)
with a correct `\\boxed{}` answer.

Model server: gymv's policy server (`gymv.rollout.policy_server`, the tiny LLaVA's tokenizer and processor,
a generation backend that answers at once with fixed tokens) against a scripted model on NeMo Gym's own
model-server stack (`SimpleResponsesAPIModel`: FastAPI, session middleware, request validation; a fixed
assistant message instead of a model). Both get the row's `responses_create_params`. The peer only
validates the request; gymv also rebuilds the prompt's tokens and image features, as it does for training.

Measured for each: p50/p99 latency of sequential requests on one kept-alive connection and on a new
connection each; requests/s and p50 with 1, 16, 64 and 256 concurrent clients, each on its own kept-alive
connection. Every server runs in its own process; the client (asyncio, one process) is shared. Servers take
turns per measurement and each measurement is repeated; the table shows medians over repeats. Times on a
machine that others load are noisy: the load average is printed with the result.

    .venv/bin/python bench/env_server_vs_nemo_gym.py [--repeats 3] [--only env|policy] [--baseline REV ...]
        [--json] [--out FILE]

`--baseline REV` (repeatable) adds gymv's servers as of commit REV (its gymv/ package on the path), to show what
a change did in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
CLIENTS = (1, 16, 64, 256)
SEQUENTIAL = 200


# ------------------------------------------------------------------------------------------------- the client

class Target:
    def __init__(self, name: str, url: str, path: str, body: bytes):
        host, port = url.removeprefix("http://").split(":")
        self.name, self.host, self.port, self.path = name, host, int(port), path
        self.request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Conn:
    """One client connection; a kept-alive connection that the server closed while idle (uvicorn closes them
    after 5 s) is opened again once, as HTTP clients' pools do, and counted."""

    reopened = 0

    def __init__(self, target: Target):
        self.target = target
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> "Conn":
        self.reader, self.writer = await asyncio.open_connection(self.target.host, self.target.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def exchange(self) -> bytes:
        try:
            return await self._exchange()
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            Conn.reopened += 1
            self.close()
            await self.open()
            return await self._exchange()

    async def _exchange(self) -> bytes:
        self.writer.write(self.target.request)
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await self.reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"{self.target.name}: HTTP {status}: {body[:300]!r}")
        return body


async def _kept_alive(target: Target, n: int) -> list[float]:
    conn = await Conn(target).open()
    await conn.exchange()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await conn.exchange()
        out.append(time.perf_counter() - t0)
    conn.close()
    return out


async def _fresh(target: Target, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn = await Conn(target).open()
        await conn.exchange()
        out.append(time.perf_counter() - t0)
        conn.close()
    return out


async def _concurrent(target: Target, clients: int, per_client: int) -> tuple[float, list[float]]:
    conns = [await Conn(target).open() for _ in range(clients)]
    await asyncio.gather(*(c.exchange() for c in conns))  # each connection served once before the clock starts
    latencies: list[float] = []

    async def client(conn: Conn) -> None:
        for _ in range(per_client):
            t0 = time.perf_counter()
            await conn.exchange()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    return clients * per_client / wall, latencies


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(target: Target, sequential: int, per_client: dict[int, int]) -> dict:
    asyncio.run(_kept_alive(target, 20))  # warm: lazy imports, caches, the first connections
    kept = asyncio.run(_kept_alive(target, sequential))
    fresh = asyncio.run(_fresh(target, sequential))
    out = {"kept_alive_p50_ms": pct(kept, 0.5) * 1e3, "kept_alive_p99_ms": pct(kept, 0.99) * 1e3,
           "fresh_p50_ms": pct(fresh, 0.5) * 1e3, "fresh_p99_ms": pct(fresh, 0.99) * 1e3}
    for clients, n in per_client.items():
        rps, lat = asyncio.run(_concurrent(target, clients, n))
        out[f"c{clients}_rps"], out[f"c{clients}_p50_ms"] = rps, pct(lat, 0.5) * 1e3
    return out


# ------------------------------------------------------------------------------------------------ the servers

class Process:
    """A server in its own process whose first stdout line is its URL."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     cwd=REPO, env=env)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise SystemExit(f"{cmd} did not print its URL")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def circle_count_row() -> tuple:
    from gymv.envs import get_env

    env = get_env("circle-count")
    return env, env.make_row(random.Random(0), env.presets["default"], 0)


def serve_env() -> None:
    """(run in a child process) `gymv env serve circle-count`'s server, from whichever gymv is on sys.path."""
    from gymv.envs import get_env
    from gymv.envs.server import EnvServer

    server = EnvServer(get_env("circle-count"), "127.0.0.1", 0)
    print(server.url, flush=True)
    server.serve_forever()


def serve_policy(model_dir: str) -> None:
    """(run in a child process) gymv's policy server with a backend that answers at once."""
    from gymv.backends.generation.base import GenerationBackend, GenerationOutput, SamplingParams
    from gymv.backends.policy import load_policy
    from gymv.rollout.policy_server import PolicyServer

    policy = load_policy(model_dir)
    ids = policy.tokenizer.encode("\\boxed{3}", add_special_tokens=False)

    class Fixed(GenerationBackend):
        tokenizer, adapter, chat_template = policy.tokenizer, policy.adapter, policy.chat_template

        def generate(self, requests, params):
            return [GenerationOutput(list(ids), [0.0] * len(ids), "\\boxed{3}", "stop") for _ in requests]

        def update_weights(self, weights):
            raise NotImplementedError

        def reset_encoder_cache(self):
            pass

    server = PolicyServer(Fixed(), params=SamplingParams(max_new_tokens=16), max_seq_len=8192, batch_wait_s=0.0)
    server.start()
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.close()


def gymv_servers(mode: list[str], baselines: list[str], tmp: Path) -> list[tuple[str, Process]]:
    """gymv's server of this checkout, and of each commit in `baselines` (its gymv/ first on the path)."""
    out = [("gymv", Process([sys.executable, __file__, *mode]))]
    for baseline in baselines:
        tree = tmp / f"gymv-{baseline}"
        if not tree.exists():
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", baseline, "gymv"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        out.append((f"gymv {baseline}", Process([sys.executable, __file__, *mode], env=env)))
    return out


def start_servers(only: str | None, baselines: list[str], tmp: Path) -> tuple[list, list]:
    """([(pair name, [(server name, Target), ...]), ...], processes to stop)."""
    from nemo_gym_peer.harness import NemoGymProcess, nemo_gym_python

    python = nemo_gym_python()
    if python is None:
        raise SystemExit("no Python 3.12 on this machine: nemo-gym 0.4.0 needs it (pyenv install 3.12)")
    env, row = circle_count_row()
    from gymv.envs.responses import request_body

    verify = json.dumps(request_body(row, env.gold_turn(row).to_items())).encode()
    respond = json.dumps({**row["responses_create_params"], "model": "policy"}).encode()
    pairs, procs = [], []
    if only in (None, "env"):
        nemo = NemoGymProcess(python, "circle_count", "resources_servers.circle_count.app:CircleCountResourcesServer")
        gymv = gymv_servers(["--serve-env"], baselines, tmp)
        procs += [nemo, *(p for _, p in gymv)]
        nemo.ready()
        servers = [("NeMo Gym", nemo.url)] + [(name, p.url) for name, p in gymv]
        pairs.append((f"env server: POST /verify, {len(verify) / 1024:.1f} KB",
                       [(name, Target(name, url, "/verify", verify)) for name, url in servers]))
    if only in (None, "policy"):
        from gymv.models.tiny import init_tiny

        model = init_tiny("tiny-llava", tmp / "tiny-llava")
        nemo = NemoGymProcess(python, "scripted_model", "scripted_model:ScriptedResponsesModel")
        gymv = gymv_servers(["--serve-policy", str(model)], baselines, tmp)
        procs += [nemo, *(p for _, p in gymv)]
        nemo.ready()
        servers = [("NeMo Gym (scripted)", nemo.url)] + [(name, p.url) for name, p in gymv]
        pairs.append((f"model server: POST /v1/responses, {len(respond) / 1024:.1f} KB",
                       [(name, Target(name, url, "/v1/responses", respond)) for name, url in servers]))
    return pairs, procs


# ------------------------------------------------------------------------------------------------------ main

def run(pairs: list, repeats: int, sequential: int, per_client: dict[int, int]) -> dict:
    results: dict = {}
    for pair, servers in pairs:
        runs: dict[str, list[dict]] = {name: [] for name, _ in servers}
        for r in range(repeats):
            for name, target in servers if r % 2 == 0 else servers[::-1]:  # turns: A B, then B A
                print(f"  {pair}: {name}, run {r + 1}/{repeats}", file=sys.stderr, flush=True)
                runs[name].append(measure(target, sequential, per_client))
        results[pair] = {name: {k: round(statistics.median(m[k] for m in ms), 2) for k in ms[0]} | {"runs": ms}
                         for name, ms in runs.items()}
    return results


def table(results: dict) -> str:
    rows = [("kept-alive p50 / p99 (ms)", "kept_alive_p50_ms", "kept_alive_p99_ms"),
            ("new connection p50 / p99 (ms)", "fresh_p50_ms", "fresh_p99_ms")]
    rows += [(f"{c} clients: req/s, p50 (ms)", f"c{c}_rps", f"c{c}_p50_ms") for c in CLIENTS]
    out = []
    for pair, servers in results.items():
        names = list(servers)
        out += [f"\n{pair}", "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for label, a, b in rows:
            if a not in servers[names[0]]:
                continue
            cells = [f"{servers[n][a]:.1f} / {servers[n][b]:.1f}" for n in names]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each server (medians are shown)")
    ap.add_argument("--sequential", type=int, default=SEQUENTIAL, help="sequential requests per latency figure")
    ap.add_argument("--requests-per-client", type=int, default=10, help="requests each concurrent client sends")
    ap.add_argument("--only", choices=["env", "policy"], help="one pair of servers only")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--baseline", metavar="REV", action="append", default=[],
                    help="also measure gymv's servers as of this commit (repeatable)")
    ap.add_argument("--serve-env", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-policy", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_env:
        return serve_env()
    if args.serve_policy:
        return serve_policy(args.serve_policy)

    per_client = {c: max(args.requests_per_client, 200 // c) for c in CLIENTS}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gymv-bench-http-") as tmp:
        pairs, procs = start_servers(args.only, args.baseline, Path(tmp))
        try:
            results = run(pairs, args.repeats, args.sequential, per_client)
        finally:
            for p in procs:
                p.stop()
    result = {"cores": len(os.sched_getaffinity(0)), "load_average_before": load_before,
              "idle_connections_reopened": Conn.reopened,
              "load_average_after": os.getloadavg(), "repeats": args.repeats, "sequential": args.sequential,
              "requests_per_client": per_client, "results": results}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['cores']} cores; load average {load_before[0]:.1f} before, {result['load_average_after'][0]:.1f} "
          f"after (the machine's other work falls on both servers alike; their ratio is the figure to read)")
    print(table(results))


if __name__ == "__main__":
    main()
