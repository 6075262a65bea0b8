"""`gymv train` launched as a user (or a SLURM job) launches it: plain per-step lines when stderr is a pipe,
TensorBoard events beside metrics.jsonl, a changed config refused instead of silently resumed, the recorded
config never rewritten, and Ctrl-C answered with the command that continues the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gymv.runs.run_dir import RunDir
from tiny_models import tiny_path
from train_helpers import REPO, plugin_env, ray_module, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_address():
    import ray

    with ray_module():
        yield ray.get_runtime_context().gcs_address


def _gymv(*args, ray_address, cwd):
    env = {**os.environ, **plugin_env(), "NO_COLOR": "1", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "gymv_cli.main", *map(str, args), "--ray-address", ray_address]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def launched(ray_address, tmp_path_factory):
    """One 2-step run, piped; then the same recipe with another learning rate; then --resume with more steps."""
    tmp = tmp_path_factory.mktemp("launch")
    settings = tiny_grpo_settings(tmp, tiny_path("tiny-llava"), **{"grpo.max_steps": 2, "logger.tensorboard": True,
                                                                    "checkpoint.dir": "runs"})
    recipe = write_recipe(tmp, "launch", "vlm_grpo.yaml", settings)
    first = _gymv("train", recipe, ray_address=ray_address, cwd=tmp)
    run = tmp / "runs" / "launch"
    config_text = (run / "config.yaml").read_text()
    changed = _gymv("train", recipe, "training.lr=0.5", ray_address=ray_address, cwd=tmp)
    config_after_refusal = (run / "config.yaml").read_text()
    resumed = _gymv("train", "--resume", "runs/launch", "grpo.max_steps=3", ray_address=ray_address, cwd=tmp)
    return {"tmp": tmp, "run": run, "first": first, "changed": changed, "resumed": resumed,
            "config_text": config_text, "config_after_refusal": config_after_refusal}


def test_piped_training_prints_one_plain_line_per_step(launched):
    first = launched["first"]
    assert first.returncode == 0, first.stderr
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("step ") and "/2 |" in ln]
    assert [ln.split()[1] for ln in lines] == ["1/2", "2/2"], first.stderr
    assert all(re.search(r"reward [\d.]+ \| .*loss .* \| elapsed \d+:\d\d:\d\d$", ln) for ln in lines), lines
    assert "\x1b[" not in first.stderr and "\r" not in first.stderr  # no terminal control in a log file
    assert "starting a local Ray cluster" in first.stderr or "joining Ray at" in first.stderr


def test_tensorboard_events_of_a_training_run_match_metrics_jsonl(launched):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(launched["run"] / "tensorboard"))
    acc.Reload()
    rows = [json.loads(x) for x in (launched["run"] / "metrics.jsonl").read_text().splitlines()]
    want = [(r["step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r]
    got = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert [s for s, _ in got] == [s for s, _ in want] and len(want) == 3  # steps 1, 2 and the resumed 3
    assert [v for _, v in got] == pytest.approx([v for _, v in want])


def test_the_same_recipe_with_another_config_is_refused_with_a_one_line_diff(launched):
    changed = launched["changed"]
    assert changed.returncode == 2, changed.stderr
    errors = [ln for ln in changed.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in changed.stderr
    line = errors[0]
    assert "runs/launch holds a run with another config: training.lr 0.001 -> 0.5" in line
    assert "gymv train --resume runs/launch" in line and "name=<new-name>" in line
    assert launched["config_after_refusal"] == launched["config_text"]


def test_resume_with_an_override_records_it_and_never_rewrites_config_yaml(launched):
    resumed, run = launched["resumed"], launched["run"]
    assert resumed.returncode == 0, resumed.stderr
    assert "config changed for this launch: grpo.max_steps 2 -> 3" in resumed.stderr
    assert (run / "config.yaml").read_text() == launched["config_text"]
    entries = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert [e["changes"] for e in entries] == [{"grpo.max_steps": [2, 3]}]
    assert RunDir(run).read_config()["grpo"]["max_steps"] == 3
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3


def test_ctrl_c_says_how_to_resume(ray_address, tmp_path):
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"grpo.max_steps": 50, "checkpoint.dir": "runs"})
    recipe = write_recipe(tmp_path, "stop", "vlm_grpo.yaml", settings)
    env = {**os.environ, **plugin_env(), "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "train", str(recipe), "--ray-address", ray_address],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    latest = tmp_path / "runs" / "stop" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert latest.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    hint = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert len(hint) == 1 and re.search(r"newest checkpoint is step_\d+; continue with: gymv train --resume runs/stop$",
                                        hint[0]), err
