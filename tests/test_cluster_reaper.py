"""A driver killed with SIGKILL leaves no Ray (or other) processes behind: the reaper stops them; a clean
shutdown leaves everything to Ray. Real processes and signals; orphans are found by making the test's
harness process a child subreaper (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tiny_models import tiny_path
from train_helpers import tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl (Linux)")

TESTS = str(Path(__file__).parent)

# A subreaper runs DRIVER_CMD in its own session, waits for READY on its stderr, SIGKILLs (or, with
# "clean", lets finish) the driver alone, and prints how many of its descendants are left and when.
_HARNESS = textwrap.dedent("""
    import ctypes, os, signal, subprocess, sys, time
    sys.path.insert(0, {tests!r})
    from net_listeners import descendants
    assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come to us
    cmd, ready, mode = {cmd!r}, {ready!r}, {mode!r}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if ready in line:
            break
    time.sleep({settle})
    me = os.getpid()
    before = len(descendants(me) - {{me}})
    if mode == "kill":
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.time()
    while time.time() - t0 < {wait}:
        for pid in descendants(me) - {{me}}:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        left = descendants(me) - {{me}}
        if not left:
            break
        time.sleep(0.2)
    print("RESULT", before, len(left), round(time.time() - t0, 1))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
""")


def _harness(cmd, ready, mode="kill", settle=0.5, wait=30, timeout=240):
    code = _HARNESS.format(tests=TESTS, cmd=cmd, ready=ready, mode=mode, settle=settle, wait=wait)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, out.stderr[-2000:]
    before, left, seconds = line.split()[1:]
    return int(before), int(left), float(seconds)


_DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from gymv.cluster.reaper import start_reaper, stop_reaper
    reaper = start_reaper()
    subprocess.Popen(["sleep", "600"], start_new_session=True)  # a child that outlives its driver on its own
    time.sleep(1.5)  # the reaper records it
    print("READY", file=sys.stderr, flush=True)
    if sys.argv[1] == "clean":
        stop_reaper(reaper)
    else:
        time.sleep(600)
""")


def test_a_killed_drivers_processes_are_stopped_by_the_reaper():
    before, left, seconds = _harness([sys.executable, "-c", _DRIVER, "kill"], "READY", wait=15)
    assert before >= 2 and left == 0 and seconds < 10


def test_a_clean_shutdown_leaves_the_drivers_processes_alone():
    before, left, _ = _harness([sys.executable, "-c", _DRIVER, "clean"], "READY", mode="clean", wait=1.5)
    assert left == 1  # the sleep: Ray's own shutdown is what stops a cluster's processes on a clean exit


@pytest.mark.slow
def test_no_ray_process_outlives_a_driver_killed_mid_run(tmp_path):
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"env.name": "circle-count", "grpo.max_steps": 50})
    recipe = write_recipe(tmp_path, "killed", "vlm_grpo.yaml", settings)
    before, left, seconds = _harness([sys.executable, "-m", "gymv_cli.main", "train", str(recipe)], "starting workers",
                                     settle=5, wait=30)
    assert before >= 5  # GCS, raylet, agents, workers: Ray was up
    assert left == 0, f"{left} processes still running {seconds} s after the driver's SIGKILL"
