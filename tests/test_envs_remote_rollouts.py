"""Multi-turn episodes through the real rollout loop against real `gymv env serve` servers, and bad input.

A scripted policy (rollout_helpers.ScriptedBackend: the tiny model's real logprobs of given replies)
plays the environments' gold episodes, since a random tiny model never calls tools. Servers run
in-process on a free 127.0.0.1 port, or as `gymv env serve` subprocesses that a test can SIGKILL.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from envs_scripts import END, gold_script, reply_text, tiny_rows, turn_of
from gymv.backends.generation import SamplingParams
from gymv.envs import Image, ModelTurn, ToolCall, ToolOutput, get_env, make_env
from gymv.envs.doorkey import DoorKey
from gymv.envs.server import EnvServer
from gymv.rollout import run_rollouts, to_rollout_record
from gymv.runs.rollout_log import validate_rollout
from rollout_helpers import ScriptedBackend
from tiny_models import shared_policy

GRID = ["#####", "#.#G#", "#AD.#", "#K#.#", "#####"]  # five moves: down, up, right, right, up
SHORT = ["######", "#AKDG#", "######"]  # three moves right: key, door, goal


@pytest.fixture(scope="module")
def policy():
    return shared_policy("tiny-llava")


def run(policy, reply, env_for, rows, *, group_size=1, max_turns=8, max_seq_len=4096, **kw):
    return run_rollouts(ScriptedBackend(policy, reply), policy.adapter, policy.tokenizer, policy.chat_template,
                        env_for, rows, group_size=group_size, params=SamplingParams(max_new_tokens=64),
                        max_turns=max_turns, max_rollout_tokens=2048, max_seq_len=max_seq_len, seed=1, **kw)


def grid_row(env, grid=GRID, size=56):
    row = tiny_rows(env, 1)[0][1]
    return {**row, "grid": grid, "image_size": size}


class Serve:
    """`gymv env serve NAME --port 0` in a subprocess; `url` from its first line."""

    def __init__(self, name: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "env", "serve", name, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        if m is None:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = m.group(0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "Serve":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self.proc.stdout.close()
        self.proc.stderr.close()


# --------------------------------------------------------------------------------------------- over HTTP


def test_polygon_naming_over_http_matches_the_in_process_episode_token_for_token(policy):
    local = get_env("polygon-naming")
    rows = tiny_rows(local, 1)
    reply = gold_script(local, dict(rows))
    with EnvServer(local) as srv:
        remote = make_env({"name": "polygon-naming", "url": srv.url, "max_turns": 3})
        over_http = run(policy, reply, remote, rows, group_size=2, max_turns=3)
    in_process = run(policy, reply, local, rows, group_size=2, max_turns=3)
    for a, b in zip(over_http, in_process):
        assert a.error is None and a.reward == b.reward == 1.0 and a.finish_reason == "stop" and a.turns == 2
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.output == b.output
        assert a.image_turns == [0, 0, 1]  # pictures 1 and 2 in the prompt, picture 3 from the tool
        assert a.agent_name == "polygon_naming_agent"
        validate_rollout(to_rollout_record(a), where="polygon over http")


@pytest.mark.slow
def test_doorkey_over_a_gymv_env_serve_subprocess_sees_a_picture_after_every_move(policy):
    env = get_env("doorkey")
    row = grid_row(env)
    with Serve("doorkey") as server:
        remote = make_env({"name": "doorkey", "url": server.url, "max_turns": 8})
        (t,) = run(policy, gold_script(env, {0: row}), remote, [(0, row)])
    assert t.error is None and t.reward == 1.0 and t.finish_reason == "stop" and t.turns == 5
    assert t.image_turns == [0, 1, 2, 3, 4]  # the last move reaches the goal: the episode ends there
    assert t.extras == {"reached_goal": True, "moves": 5, "has_key": True, "door_open": True}
    policy.adapter.check(t.token_ids, t.images, where="doorkey over http")


@pytest.mark.slow
def test_a_server_killed_mid_run_fails_only_its_own_trajectories(policy):
    env = get_env("doorkey")
    rows = [(i, grid_row(env)) for i in range(2)]
    gold = gold_script(env, dict(rows))
    with Serve("doorkey") as doomed, EnvServer(env) as healthy:
        dying = make_env({"name": "doorkey", "url": doomed.url, "max_turns": 8, "retries": 2},
                         backoff_s=0.05)
        alive = make_env({"name": "doorkey", "url": healthy.url, "max_turns": 8})

        def reply(where: str) -> str:
            if turn_of(where) == 2:
                doomed.kill()  # SIGKILL between the second and third move
            return gold(where)

        t0 = time.time()
        trajs = run(policy, reply, lambda row: dying if row["_server"] == "doomed" else alive,
                    [(i, {**r, "_server": "doomed" if i == 0 else "healthy"}) for i, r in rows])
    killed, fine = trajs
    assert killed.finish_reason == "error" and "POST /step failed after 3 attempts" in killed.error
    assert killed.turns == 3 and killed.reward == 0.0
    validate_rollout(to_rollout_record(killed), where="killed")
    assert fine.error is None and fine.reward == 1.0 and fine.turns == 5
    assert time.time() - t0 < 30


def test_a_server_that_is_gone_before_the_run_marks_every_episode_at_start(policy):
    env = get_env("doorkey")
    row = grid_row(env)
    srv = EnvServer(env).start()
    remote = make_env({"name": "doorkey", "url": srv.url, "retries": 1}, backoff_s=0.01)
    srv.close()
    trajs = run(policy, gold_script(env, {0: row}), remote, [(0, row)], group_size=2)
    assert all(t.finish_reason == "error" and "POST /reset failed" in t.error and t.token_ids == [] for t in trajs)


# ------------------------------------------------------------------------------------------- bad input


class FragileDoorKey(DoorKey):
    """A row's `_fault` breaks its move tool: "raise" crashes it, "image" answers bytes that are no image."""

    def _move(self, state, args):
        fault = state.row.get("_fault")
        if fault == "raise":
            raise RuntimeError("the renderer crashed")
        if fault == "image":
            return ToolOutput("moved", [Image("data:image/png;base64,bm90IGFuIGltYWdl")])
        return super()._move(state, args)


def move(direction: str) -> str:
    return reply_text(ModelTurn(tool_calls=[ToolCall("move", f'{{"direction": "{direction}"}}', "x")]))


@pytest.mark.parametrize("over_http", [False, True], ids=["in-process", "over-http"])
def test_a_tool_that_raises_or_returns_an_unreadable_image_fails_only_that_trajectory(policy, over_http):
    env = FragileDoorKey()
    rows = [(i, {**grid_row(env, SHORT), "_fault": fault}) for i, fault in enumerate(["raise", "image", None])]
    fragile_reply = gold_script(env, dict(rows))
    if over_http:
        with EnvServer(env) as srv:
            trajs = run(policy, fragile_reply, make_env({"url": srv.url, "retries": 1}, backoff_s=0.01), rows)
    else:
        trajs = run(policy, fragile_reply, env, rows)
    raised, unreadable, fine = trajs
    assert raised.finish_reason == "error" and "RuntimeError: the renderer crashed" in raised.error
    assert unreadable.finish_reason == "error" and "unusable image" in unreadable.error
    assert fine.error is None and fine.reward == 1.0
    assert raised.turns == unreadable.turns == 1


def test_a_model_that_never_stops_calling_tools_is_ended_by_the_turn_limit(policy):
    env = get_env("doorkey", max_turns=30)
    row = grid_row(env, SHORT)
    (t,) = run(policy, lambda w: move("left"), env, [(0, row)], max_turns=4)  # walks into a wall forever
    assert t.turns == 4 and t.finish_reason == "max_turns" and t.error is None
    assert t.reward == 0.0 and t.failure_reason == "goal_not_reached" and len(t.images) == 4


def test_a_model_that_never_stops_calling_tools_over_http_is_ended_by_the_servers_limit(policy):
    env = get_env("polygon-naming")
    row = tiny_rows(env, 1)[0][1]
    fetch = reply_text(env.gold_turns(row)[0])
    with EnvServer(env) as srv:  # polygon-naming allows 3 turns
        (t,) = run(policy, lambda w: fetch, make_env({"url": srv.url}), [(0, row)], max_turns=10)
    assert t.turns == 3 and t.finish_reason == "stop" and t.error is None
    assert t.reward == 0.0 and t.failure_reason == "no_answer"


@pytest.mark.slow
def test_a_conversation_longer_than_the_context_is_truncated_and_marked_not_crashed(policy):
    env = get_env("doorkey")
    row = grid_row(env)
    with EnvServer(env) as srv:
        remote = make_env({"url": srv.url, "max_turns": 8})
        (full,) = run(policy, gold_script(env, {0: row}), remote, [(0, row)])
        limit = full.model_calls[2]["generation_start"] + 10  # the third move has room for 10 tokens
        (t,) = run(policy, gold_script(env, {0: row}), remote, [(0, row)], max_seq_len=limit)
    assert t.truncated and t.finish_reason == "length" and t.error is None
    assert len(t.token_ids) <= limit and t.token_ids == full.token_ids[:len(t.token_ids)]
    assert t.turns == 3 and t.reward == 0.0 and t.failure_reason == "goal_not_reached"
    policy.adapter.check(t.token_ids, t.images, where="truncated")
    validate_rollout(to_rollout_record(t), where="truncated")


def test_scripted_follow_ups_over_http_end_the_episode_after_the_last_answer(policy):
    env = get_env("scripted")
    rows = tiny_rows(env, 2)
    with EnvServer(env) as srv:
        trajs = run(policy, gold_script(env, dict(rows), after=f"extra{END}"),
                    make_env({"name": "example-multi-turn-gymnasium", "url": srv.url, "max_turns": 5}), rows)
    for t, (_, row) in zip(trajs, rows):
        assert t.reward == 1.0 and t.turns == 2 and t.finish_reason == "stop"
        assert [i.get("role") for i in t.output if i["type"] == "message"] == ["assistant", "user", "assistant"]
        assert t.agent_name == "example_multi_turn_gymnasium_agent"


# ------------------------------------------------------------------------------------------- concurrency


class _Counting:
    """Wraps an environment's step: how many steps run at once (each takes `delay_s`)."""

    def __init__(self, env, delay_s: float):
        import threading

        self.env, self.delay_s, self.lock = env, delay_s, threading.Lock()
        self.now = self.most = 0
        inner = env.step

        def step(state, turn):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(self.delay_s)
                return inner(state, turn)
            finally:
                with self.lock:
                    self.now -= 1

        env.step = step


def test_remote_episodes_of_a_batch_step_their_server_concurrently_with_the_same_results(policy):
    local = get_env("polygon-naming")
    rows = tiny_rows(local, 2)
    reply = gold_script(local, dict(rows))
    served = get_env("polygon-naming")
    counting = _Counting(served, delay_s=0.05)
    with EnvServer(served) as srv:
        remote = make_env({"name": "polygon-naming", "url": srv.url, "max_turns": 3})
        over_http = run(policy, reply, remote, rows, group_size=3, max_turns=3)
    in_process = run(policy, reply, local, rows, group_size=3, max_turns=3)
    assert counting.most > 1  # six episodes, one step each per turn, in flight together
    assert [t.token_ids for t in over_http] == [t.token_ids for t in in_process]
    assert [t.reward for t in over_http] == [t.reward for t in in_process] == [1.0] * 6


def test_in_process_environments_are_stepped_one_episode_at_a_time(policy):
    env = get_env("polygon-naming")
    rows = tiny_rows(env, 2)
    counting = _Counting(env, delay_s=0.01)
    out = run(policy, gold_script(env, dict(rows)), env, rows, group_size=3, max_turns=3)
    assert counting.most == 1 and all(t.reward == 1.0 for t in out)


def test_env_serve_latency_delays_each_step_by_the_configured_time():
    from gymv.envs.client import EnvClient

    env = get_env("polygon-naming")
    row = tiny_rows(env, 1)[0][1]
    with EnvServer(env, step_latency_s=0.2) as srv:
        client = EnvClient(srv.url)
        client.reset(row)
        t0 = time.perf_counter()
        client.step(row, [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "no idea"}]}])
        assert time.perf_counter() - t0 >= 0.2
