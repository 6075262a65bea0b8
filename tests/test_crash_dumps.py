"""A test process killed by a fatal signal leaves the Python stacks of all its threads in GYMV_TEST_CRASH_DIR
(tests/crash_dumps.py), even when something pointed faulthandler at pytest's capture before, or Ray was stopped
and started again in it: a real child pytest on a pytest-xdist worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

DIES = '''import faulthandler
import os
import threading


def test_a_library_points_faulthandler_at_the_captured_stderr():
    faulthandler.disable()
    faulthandler.enable()  # on sys.stderr of the moment: this test's capture


def test_a_thread_aborts_the_process():
    thread = threading.Thread(target=os.abort)
    thread.start()
    thread.join()
'''


def child_pytest(folder, crash_dir, *plugins: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "GYMV_TEST_CRASH_DIR": str(crash_dir)}
    args = [a for p in plugins for a in ("-p", p)]
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "-q", "-n", "1",
                           "--dist", "loadfile"], cwd=folder, env=env, capture_output=True, text=True, timeout=60)


RAY_RESTARTED = '''import os

from gymv.cluster.ray_cluster import start_ray, stop_ray


def test_ray_is_stopped_and_started_again():
    start_ray()
    stop_ray()
    start_ray()


def test_the_process_aborts():
    os.abort()
'''


def suite(tmp_path, text: str = DIES):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_dies.py").write_text(text)
    return tmp_path


def test_an_aborted_worker_leaves_every_threads_stack_in_a_file_of_its_own(tmp_path):
    crash_dir = tmp_path / "crashes"
    r = child_pytest(suite(tmp_path), crash_dir, "crash_dumps", "xdist_scheduling")
    assert "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    [dump] = list(crash_dir.iterdir())  # the replacement worker and the controller ended normally: no file
    assert dump.name.startswith("gw0-")
    text = dump.read_text()
    assert text.startswith("Fatal Python error: Aborted")
    assert "in test_a_thread_aborts_the_process" in text  # the main thread, waiting on the one that aborted
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 2


def test_without_the_plugin_the_same_abort_leaves_no_stacks_anywhere(tmp_path):
    crash_dir = tmp_path / "crashes"
    r = child_pytest(suite(tmp_path), crash_dir, "xdist_scheduling")
    assert "1 failed, 1 passed" in r.stdout
    assert "Fatal Python error" not in r.stdout + r.stderr and not crash_dir.exists()


@pytest.mark.slow
def test_an_abort_after_ray_started_a_second_time_in_the_process_still_leaves_the_stacks(tmp_path):
    # without the plugin this run prints no stacks: Ray's handlers, installed anew, no longer lead to faulthandler's
    crash_dir = tmp_path / "crashes"
    r = child_pytest(suite(tmp_path, RAY_RESTARTED), crash_dir, "crash_dumps", "xdist_scheduling")
    assert "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    [dump] = list(crash_dir.iterdir())
    text = dump.read_text()
    assert text.startswith("Fatal Python error: Aborted") and "in test_the_process_aborts" in text
