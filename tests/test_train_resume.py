"""A run in three launches — stopped by `checkpoint.steps_per_run`, then continued by `gymv train --resume`
in a subprocess killed with SIGKILL right after a checkpoint, then resumed to the end — against a run never
interrupted: no step lost or repeated, the same rows in the same order, the same samples, and bit-identical
final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gymv.runs.rollout_log import read_rollouts
from gymv.train import train
from tiny_models import tiny_path
from train_helpers import REPO, plugin_env, ray_module, read_weights, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow

STEPS = 5


@pytest.fixture(scope="module")
def ray_address():
    import ray

    with ray_module():
        yield ray.get_runtime_context().gcs_address


def _gymv(*args, ray_address: str):
    env = {**os.environ, **plugin_env(), "NO_COLOR": "1", "COLUMNS": "200"}
    return [sys.executable, "-m", "gymv_cli.main", *map(str, args), "--ray-address", ray_address], env


def _recipe(dir, name):
    settings = tiny_grpo_settings(dir, tiny_path("tiny-llava"), **{"grpo.max_steps": STEPS, "checkpoint.keep": 2})
    return write_recipe(dir, name, "vlm_grpo.yaml", settings)


def _wait_for_checkpoint(proc, run, step, timeout=240):
    latest = run / "checkpoints" / "latest"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if latest.exists() and latest.read_text().strip() == f"step_{step}":
            return
        if proc.poll() is not None:
            raise AssertionError(f"gymv train exited early: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


@pytest.fixture(scope="module")
def runs(ray_address, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    (base / "a").mkdir()
    (base / "b").mkdir()
    killed_run = base / "a" / "runs" / "r"

    first = train(_recipe(base / "a", "r"), ["checkpoint.steps_per_run=2"])
    segment = [json.loads(x)["step"] for x in (killed_run / "metrics.jsonl").read_text().splitlines()]

    cmd, env = _gymv("train", "--resume", killed_run, "checkpoint.steps_per_run=null", ray_address=ray_address)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_checkpoint(proc, killed_run, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps_before = [json.loads(x)["step"] for x in (killed_run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps_before) < STEPS, "the run finished before it could be killed"

    summary = train(None, ["checkpoint.steps_per_run=null"], resume_dir=str(killed_run))
    assert not first["complete"] and first["step"] == 2
    train(_recipe(base / "b", "r"))
    return killed_run, base / "b" / "runs" / "r", summary, segment


def test_steps_per_run_stops_after_saving_that_many_steps(runs):
    killed, _, _, segment = runs
    assert segment == [1, 2]


def test_resumed_run_logs_every_step_exactly_once(runs):
    killed, _, summary, _ = runs
    steps = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert summary["step"] == STEPS and summary["complete"] and summary["steps_run"] < STEPS


def test_resumed_run_draws_the_same_rows_and_samples_the_same_tokens(runs):
    killed, clean, _, _ = runs
    for step in range(1, STEPS + 1):
        a = read_rollouts(killed / "rollouts" / f"step_{step}.jsonl")
        b = read_rollouts(clean / "rollouts" / f"step_{step}.jsonl")
        assert [r["_ng_task_index"] for r in a] == [r["_ng_task_index"] for r in b]
        tokens = lambda rs: [r["response"]["output"][-1]["generation_token_ids"] for r in rs]  # noqa: E731
        assert tokens(a) == tokens(b), f"step {step}"


def test_resumed_run_ends_with_bit_identical_weights(runs):
    killed, clean, _, _ = runs
    a, b = read_weights(killed / "final"), read_weights(clean / "final")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = read_weights(tiny_path("tiny-llava"))
    assert a.keys() == start.keys() and any(not torch.equal(start[k], a[k]) for k in a)  # the weights did train


def test_resume_keeps_only_the_newest_checkpoints(runs):
    killed, _, _, _ = runs
    # (a `.tmp-` folder the killed launch's trainer was still writing may remain: readers ignore those)
    names = sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ["latest", f"step_{STEPS - 1}", f"step_{STEPS}"], names
