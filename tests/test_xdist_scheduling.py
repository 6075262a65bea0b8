"""The suite's `--dist loadfile` scheduler (tests/xdist_scheduling.py) when a worker dies: a real child pytest on
pytest-xdist workers over a few tiny files, one of whose tests kills its worker process. Without the plugin the
same run waits forever once the worker is gone (pytest-xdist 3.8)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO

FILES = {
    # three tests: handed out first, and finished before the crash (the finished file must not come back)
    "test_first.py": "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n\n\ndef test_three():\n    pass\n",
    "test_second.py": "def test_done():\n    pass\n",
    "test_third.py": "import os\n\n\ndef test_dies():\n    os._exit(1)\n\n\ndef test_after():\n    pass\n",
    "test_fourth.py": "def test_last():\n    pass\n",  # one test: a replacement worker handed only this must run it
}


def child_pytest(folder, *args: str, timeout: float = 60) -> str:
    """Run pytest in `folder` (its own rootdir) with the plugin loaded; its output. A run still going after
    `timeout` seconds is killed with its workers, and the test fails saying it hung."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist_scheduling",
                             "-q", "-rA", *args], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the child pytest hung (killed after {timeout} s):\n{out}")
    return out


@pytest.fixture
def crashing_suite(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_worker_crash_fails_its_test_once_and_the_run_ends_with_every_other_test_run_once(crashing_suite,
                                                                                             workers):
    out = child_pytest(crashing_suite, "-n", workers, "--dist", "loadfile")
    assert "node down: Not properly terminated" in out, out
    outcomes = sorted(re.findall(r"^(PASSED|FAILED) (\S+)", out, re.M))
    assert outcomes == sorted([("FAILED", "test_third.py::test_dies")] + [
        ("PASSED", f"{f}::{t}") for f, t in [("test_first.py", "test_one"), ("test_first.py", "test_two"),
                                             ("test_first.py", "test_three"), ("test_second.py", "test_done"),
                                             ("test_third.py", "test_after"), ("test_fourth.py", "test_last")]]), out
    assert re.search(r"crashed while running 'test_third.py::test_dies'", out)
    assert "1 failed, 6 passed" in out.splitlines()[-1]


def test_loadfile_runs_are_scheduled_by_the_plugin(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    assert "scheduling tests via CrashSafeLoadFileScheduling" in child_pytest(tmp_path, "-vv", "-n", "1",
                                                                              "--dist", "loadfile")


def test_without_xdist_the_plugin_does_nothing(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    out = child_pytest(tmp_path, "-p", "no:xdist")
    assert out.splitlines()[-1].startswith("1 passed"), out
