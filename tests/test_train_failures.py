"""A run whose rollouts keep failing stops with the cause instead of "training" on nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from gymv.errors import GymvError
from gymv.rollout.types import Trajectory
from gymv.train import Reporter, train
from gymv.train.failures import FailureGuard
from tiny_models import tiny_path
from train_helpers import plugin_on_path, tiny_grpo_settings, write_recipe


def batch(n_ok: int, n_failed: int, error: str = "environment start failed: server down") -> list[Trajectory]:
    ok = [Trajectory(row={}, task_index=i, sample_index=0, agent_name="a") for i in range(n_ok)]
    bad = [Trajectory(row={}, task_index=n_ok + i, sample_index=1, agent_name="a", error=error) for i in range(n_failed)]
    return ok + bad


def test_a_step_with_more_failed_rollouts_than_allowed_stops_naming_the_cause_and_its_row():
    guard = FailureGuard(max_step_fraction=0.5, source="data/train.jsonl")
    with pytest.raises(GymvError) as e:
        guard.check(3, batch(1, 3, "environment step failed at turn 0: RemoteEnvError: http://127.0.0.1:9/step down"))
    text = e.value.one_line()
    assert "3 of 4 rollouts of step 3 failed" in text
    assert "http://127.0.0.1:9/step down" in text and "data/train.jsonl line 2" in text
    assert "env.max_failed_fraction" in text and "not trained" in text


def test_a_step_at_the_limit_goes_on():
    FailureGuard(max_step_fraction=0.5).check(1, batch(2, 2))


def test_a_step_where_every_rollout_failed_stops_even_with_a_lenient_window():
    with pytest.raises(GymvError, match="4 of 4 rollouts"):
        FailureGuard(max_step_fraction=0.9, window_steps=100, max_window_fraction=1.0).check(1, batch(0, 4))


def test_a_steady_trickle_of_failures_stops_once_the_window_fills():
    guard = FailureGuard(max_step_fraction=0.5, window_steps=3, max_window_fraction=0.2)
    guard.check(1, batch(3, 1))  # 25% each step: under the per-step limit, the window not yet full
    guard.check(2, batch(3, 1))
    with pytest.raises(GymvError, match=r"3 of 12 rollouts of the last 3 steps \(to step 3\) failed.*max_failed_fraction_window"):
        guard.check(3, batch(3, 1))


def test_failures_that_stop_within_the_window_are_forgiven():
    guard = FailureGuard(max_step_fraction=0.5, window_steps=2, max_window_fraction=0.2)
    guard.check(1, batch(3, 1))
    for step in range(2, 6):
        guard.check(step, batch(4, 0))


def test_every_failure_under_the_limits_is_a_warning_naming_its_cause_and_row():
    said: list[str] = []
    guard = FailureGuard(max_step_fraction=0.5, source="data/train.jsonl", warn=said.append)
    guard.check(1, batch(4, 0))
    guard.check(2, batch(7, 1, "the prompt has 1000 images, over the limit of 8 (vision.max_images_per_sample)"))
    assert len(said) == 1 and said[0].startswith("warning: 1 of 8 rollouts of step 2 failed and are left out")
    assert "1000 images" in said[0] and "data/train.jsonl line 8" in said[0]


class _StallServerAfter(Reporter):
    """SIGSTOPs the environment server once step `step` is logged (a hung, not a dead, server)."""

    def __init__(self, pid: int, step: int):
        self.pid, self.step = pid, step

    def on_step(self, step, metrics):
        if step == self.step:
            os.kill(self.pid, signal.SIGSTOP)


@pytest.mark.slow
def test_a_server_that_stalls_mid_run_stops_it_untrained_with_the_servers_url(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "env", "serve", "circle-count", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", server.stdout.readline()).group(0)
        settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
            "env.name": "circle-count", "env.preset": "tiny", "env.url": url, "env.timeout_s": 2, "env.retries": 1,
            "grpo.max_steps": 3})
        with pytest.raises(GymvError) as e:
            train(write_recipe(tmp_path, "stall", "vlm_grpo.yaml", settings), reporter=_StallServerAfter(server.pid, 1))
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
    text = e.value.one_line()
    assert "rollouts of step 2 failed" in text and url in text and "step_1" in text
    run = tmp_path / "runs" / "stall"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # step 2 was neither logged nor checkpointed: a resume redoes it
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1"]
    assert not (run / "final").exists()


@pytest.mark.slow
def test_a_disk_that_fills_up_at_a_checkpoint_stops_the_run_with_the_cause_and_how_to_resume(tmp_path, tmpfs,
                                                                                           monkeypatch):
    from gymv.train.loop import Checkpointer

    monkeypatch.setattr(Checkpointer, "retry_wait_s", 0.0)
    disk = tmpfs("1m")  # the run's config, rows and metrics fit; its first checkpoint does not
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"checkpoint.dir": str(disk / "runs"),
                                                                         "grpo.max_steps": 2})
    said: list[str] = []

    class Listen(Reporter):
        def on_message(self, text):
            said.append(text)

    with plugin_on_path(), pytest.raises(GymvError) as e:
        train(write_recipe(tmp_path, "full", "vlm_grpo.yaml", settings), reporter=Listen())
    text = e.value.one_line()
    assert "checkpoint of step 1 could not be written, twice" in text and "No space left on device" in text
    assert f"gymv train --resume {disk / 'runs' / 'full'}" in text and "learning rate" not in text
    assert e.value.exit_code == 1
    assert any("kept in memory, trying again" in m for m in said)
    rows = [json.loads(x) for x in (disk / "runs" / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # the step ran; resuming redoes it alone
