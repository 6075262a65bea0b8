"""`gymv cluster`: the batch script asks SLURM for the recipe's nodes and GPUs, and the launcher it runs starts
a Ray head and a worker on the allocation's nodes, runs a short training on them, and stops them. SLURM
itself is not here: `scontrol` and `srun` are replaced by a test harness that lists two nodes named by
loopback addresses (127.0.0.2 and 127.0.0.3: Ray dials the host's network address for 127.0.0.1 itself) and
runs each task on this host; everything else is gymv's own code and real Ray."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gymv.cluster.slurm import BatchJob
from tiny_models import tiny_path
from train_helpers import REPO, plugin_env, tiny_grpo_settings, write_recipe

SCONTROL = """#!/bin/sh
# test harness for SLURM's scontrol: `scontrol show hostnames A,B` prints one name per line
[ "$1" = show ] && [ "$2" = hostnames ] && echo "$3" | tr ',' '\\n'
"""
SRUN = """#!/usr/bin/env bash
# test harness for SLURM's srun: drops srun's own options and runs the task on this host
while [[ "${1:-}" == --* ]]; do shift; done
exec "$@"
"""


def test_the_batch_script_asks_for_the_recipes_nodes_and_gpus_and_runs_the_launcher():
    job = BatchJob(2, 8, ("gymv", "train", "r.yaml", "grpo.max_steps=5"), "r", time="4:00:00", account="me")
    script = job.script()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --time=4:00:00", "#SBATCH --account=me"):
        assert line in script.splitlines()
    assert script.rstrip().endswith("cluster up --gpus-per-node=8 -- gymv train r.yaml grpo.max_steps=5")
    assert "--partition" not in script


def test_outside_an_allocation_the_launcher_runs_the_command_as_it_is(gymv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = gymv("cluster", "up", "--", sys.executable, "-c", "import sys; sys.exit(3)", env=env)
    assert r.code == 3 and "not inside a SLURM allocation" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.2", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_the_generated_job_starts_two_labelled_ray_nodes_trains_on_them_and_stops_them(tmp_path, gymv):
    harness = tmp_path / "bin"
    harness.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (harness / name).write_text(text)
        (harness / name).chmod(0o755)
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
        "grpo.max_steps": 1, "cluster.num_nodes": 2, "cluster.ray_address": "${oc.env:RAY_ADDRESS,null}",
        "cluster.placement.generation.labels": {"gymv-node": "0"},
        "cluster.placement.training.labels": {"gymv-node": "1"}})
    recipe = write_recipe(tmp_path, "slurm", "vlm_grpo.yaml", settings)
    port = _free_port()
    made = gymv("cluster", "sbatch", recipe, "--port", str(port), "--write", tmp_path / "job.sh", cwd=tmp_path)
    assert made.code == 0, made.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env.update(plugin_env(), PATH=f"{harness}{os.pathsep}{env['PATH']}", HOME=str(tmp_path),
               SLURM_JOB_ID="1", SLURM_JOB_NODELIST="127.0.0.2,127.0.0.3")
    try:
        job = subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True, timeout=900)
    finally:  # the head's Ray temp dir (logs, sockets): short, under the system's temp dir
        shutil.rmtree(Path(tempfile.gettempdir()) / f"gymv-ray-1-{port}", ignore_errors=True)
    assert job.returncode == 0, job.stderr[-3000:]
    placed = json.loads((tmp_path / "runs" / "slurm" / "placement.json").read_text())
    label = {n["node_id"]: n["labels"].get("gymv-node") for n in placed["nodes"]}
    assert sorted(label.values()) == ["0", "1"]
    assert [label[w["node_id"]] for w in placed["roles"]["training"]["workers"]] == ["1"]
    assert [label[w["node_id"]] for w in placed["roles"]["generation"]["workers"]] == ["0"]
    assert "Ray cluster of 2 nodes at 127.0.0.2:" in job.stderr
    end = time.monotonic() + 30
    while _listening(port) and time.monotonic() < end:
        time.sleep(0.5)
    assert not _listening(port)  # the head is gone with the job


def test_a_drivers_batch_script_asks_for_what_dry_run_counts_for_one_of_its_runs():
    from gymv.recipes.drivers import parse_driver

    driver = REPO / "recipes/drivers/vlm/vlm_mopd-qwen2.5-vl-3b-2n8g-megatron-noncolocated.sh"
    counted = parse_driver(driver)
    script = BatchJob.for_driver(driver, ["mopd.max_steps=10"]).script().splitlines()
    assert {f"#SBATCH --nodes={counted.num_nodes}", f"#SBATCH --gpus-per-node={counted.gpus_per_node}",
            f"#SBATCH --time={counted.num_minutes}"} <= set(script)
    assert script[-1] == f"exec bash {driver} mopd.max_steps=10"  # the driver goes through `gymv cluster up`
    assert "exec gymv cluster up -- gymv train" in driver.read_text()
