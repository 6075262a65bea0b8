"""`gymv env serve` under thousands of hostile bodies: every answer is a 2xx or a 4xx, never a 500.

Each body is a valid request of some environment (a row to seed, reset or verify, a turn to step, a tool's
arguments) with one to three random mutations: a value swapped for a hostile one (numbers of 100,000 digits,
NaN, infinities, huge strings, `\\boxed{}` with endless digits, deep nesting, wrong types), a key removed or
added; or the raw bytes cut short or corrupted.
"""

from __future__ import annotations

import copy
import http.client
import json
import random
from collections import Counter

import pytest

from gymv.envs import get_env
from gymv.envs.registry import available
from gymv.envs.responses import request_body
from gymv.envs.server import EnvServer

BODIES = 3000
LONG_INT = "9" * 100_000  # spliced in as raw text: Python's json cannot write it

HOSTILE: list = [None, True, 0, -1, 2**63, 10**400, 1e308, float("nan"), float("inf"), float("-inf"), "", "x" * 100_000,
                 [], {}, [[[[[[[[[[[]]]]]]]]]]], "²", "٣", "\\boxed{" + "7" * 50_000 + "}", "\\boxed{-0}",
                 "data:image/png;base64,AAAA", "data:image/png;base64," + "A" * 4000, "\x00", "\ud800",
                 {"type": "function_call", "name": "click", "arguments": '{"x": ' + "9" * 5000 + ', "y": 1}'},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{3}"}]},
                 "@@LONG_INT@@", ["@@LONG_INT@@"], {"x": "@@LONG_INT@@", "y": 1}]


def hostile(rng: random.Random):
    return copy.deepcopy(rng.choice(HOSTILE))


def base_requests(env_name: str) -> list[tuple[str, dict]]:
    env = get_env(env_name)
    row = env.make_row(random.Random(0), env.presets["tiny"], 0)
    items = [item for turn in env.gold_turns(row) for item in turn.to_items()]
    reqs = [("/seed_session", row), ("/reset", row), ("/verify", request_body(row, items)),
            ("/step", request_body(row, items)),
            ("/aggregate_metrics", {"verify_responses": [{**row, "reward": 1.0}, {**row, "reward": 0.0}]})]
    for item in items:
        if item.get("type") == "function_call":
            reqs.append((f"/{item['name']}", json.loads(item["arguments"])))
    return reqs


def paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if not (isinstance(v, str) and len(v) > 1000):  # an image's data: mutate it whole, not inside
            yield from paths(v, (*prefix, k))
        else:
            yield (*prefix, k)


def mutate(rng: random.Random, body):
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(list(paths(body)))
        if not where:
            body = hostile(rng)
            continue
        parent = body
        for k in where[:-1]:
            parent = parent[k]
        key, kind = where[-1], rng.random()
        if kind < 0.15 and isinstance(parent, dict):
            parent.pop(key)
        elif kind < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["extra", "response", "circles", "target_color", "output", "arguments"])] = \
                hostile(rng)
        else:
            parent[key] = hostile(rng)
    return body


def encode(rng: random.Random, body) -> bytes:
    raw = json.dumps(body).replace('"@@LONG_INT@@"', LONG_INT).encode("utf-8", "surrogatepass")
    kind = rng.random()
    if kind < 0.05:
        return raw[:rng.randrange(len(raw) + 1)]
    if kind < 0.10:
        at = rng.randrange(len(raw) + 1)
        return raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
    return raw


@pytest.mark.slow
def test_no_random_body_gets_a_500():
    rng = random.Random(30)
    names = [n for n, origin in available().items() if origin == "builtin"]
    servers = {n: EnvServer(get_env(n)).start() for n in names}
    try:
        bases = [(n, path, body) for n in names for path, body in base_requests(n)]
        conns = {n: http.client.HTTPConnection(s.host, s.port, timeout=30) for n, s in servers.items()}
        statuses: Counter = Counter()
        failures = []
        for i in range(BODIES):
            name, path, body = rng.choice(bases)
            raw = encode(rng, mutate(rng, body))
            conn = conns[name]
            conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = resp.read()
            statuses[resp.status] += 1
            if resp.status >= 500:
                failures.append(f"body {i} to {name} {path}: {resp.status} {answer[:300]!r}")
            if resp.will_close:
                conn.close()
        assert not failures, f"{len(failures)} of {BODIES} bodies got a 5xx:\n" + "\n".join(failures[:10])
        assert sum(statuses.values()) == BODIES and statuses[200] > BODIES // 10 and statuses[422] > BODIES // 10
    finally:
        for s in servers.values():
            s.close()
