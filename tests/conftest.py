"""Shared fixtures: the `gymv` CLI in this process (argument-level tests) or in a subprocess (where the process
boundary is the point: exit on a signal, import time, a fresh interpreter's environment), and the shared
NeMo Gym vectors."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO.parent / "shared" / "vectors"

# Under pytest-xdist's `--dist loadfile` (scripts/test.sh), a scheduler that ends the run when a worker crashes
# instead of waiting forever (tests/xdist_scheduling.py says why; without xdist it does nothing); and with
# GYMV_TEST_CRASH_DIR set, the Python stacks of a test process killed by a fatal signal (tests/crash_dumps.py).
pytest_plugins = ["xdist_scheduling", "crash_dumps"]

CLI_ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
os.environ.update(CLI_ENV)  # before rich's consoles are made: in-process output is laid out as a subprocess's


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_gymv(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None, timeout: float = 300) -> CliResult:
    """Invoke the installed CLI exactly as a user would (a fresh interpreter, real argv)."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "gymv_cli.main", *map(str, args)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    return CliResult(p.returncode, p.stdout, p.stderr)


@contextlib.contextmanager
def _cwd(path: str | os.PathLike | None):
    old = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def invoke_gymv(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None,
                timeout: float | None = None) -> CliResult:
    """The CLI in this process, through typer's CliRunner (its stdout, stderr and environment isolation): what
    `run_gymv` gives, without a fresh interpreter's import time. `--debug` lets a traceback through, which is
    printed to stderr with exit code 1 as the interpreter would."""
    from typer.testing import CliRunner

    from gymv_cli.main import main

    isolated_env = {**CLI_ENV, "GYMV_DEBUG": None, **(env or {})}  # every key given is restored afterwards
    with _cwd(cwd), CliRunner().isolation(env=isolated_env) as (out, err, _):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return CliResult(code, stdout, stderr)


@pytest.fixture
def gymv():
    """The CLI for argument-level tests (in this process); tests about the process itself use `run_gymv`."""
    return invoke_gymv


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size) -> the folder of a real tmpfs of that size ("4m"): a disk that fills up or turns read-only
    for real. Mounting needs root; elsewhere the test is skipped. Unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture(scope="module")
def faulty_model(tmp_path_factory):
    """A copy of the tiny LLaVA of the module's own, whose engines of the plugin backends in
    tests/train_plugin/gymv_faulty_refits.py load refits with the fault `set_fault` names (none at first)."""
    import shutil

    from tiny_models import tiny_path

    model = shutil.copytree(tiny_path("tiny-llava"), tmp_path_factory.mktemp("faulty") / "model")
    yield model
    (model.parent / f"{model.name}.refit-fault").unlink(missing_ok=True)


@pytest.fixture
def vectors() -> Path:
    if not VECTORS.exists():
        pytest.skip(f"shared vectors not found at {VECTORS}")
    return VECTORS


# The modules that cost about a minute or more on 2 cores, heaviest first: run before the rest, so that the two
# pytest-xdist workers of scripts/test.sh (one file at a time each) finish together rather than one of them
# starting the biggest file last.
HEAVY_FIRST = ("test_train_env_learning.py", "test_learning_nemotron_omni.py", "test_mopd_train.py",
               "test_train_agents.py", "test_refit_check_ray.py", "test_reference_layouts_smoke.py",
               "test_train_grpo_async.py", "test_model_families_train.py", "test_cluster_two_nodes.py",
               "test_smoke_e2e.py", "test_train_grpo.py", "test_cluster_slurm.py", "test_mopd_train_megatron.py",
               "test_train_fsdp.py", "test_train_launch.py", "test_train_megatron_omni.py", "test_quickstart_golden.py",
               "test_train_resume.py", "test_train_sft.py", "test_nemo_gym_interop.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ------------------------------------------------------------------------------------------ suite timing
# Printed at the end of every run, so that CI's log shows the suite's cost against its targets (CONTRIBUTING.md):
# the fast set's share is the test time of the tests not marked slow, read from the same run.

_TIMES: dict[str, float] = {}
_SLOW: set[str] = set()
_START = [time.monotonic()]


def pytest_sessionstart(session):
    _START[0] = time.monotonic()


def pytest_runtest_logreport(report):
    # read from the report, not the collection: under pytest-xdist the controller collects nothing
    _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:
        _SLOW.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """The local Ray the test modules shared (tests/train_helpers.ray_module), stopped with the session."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from gymv.cluster.ray_cluster import stop_ray

        stop_ray()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TIMES:
        return
    slow = sum(t for n, t in _TIMES.items() if n in _SLOW)
    fast = sum(t for n, t in _TIMES.items() if n not in _SLOW)
    n_slow = sum(1 for n in _TIMES if n in _SLOW)
    terminalreporter.write_sep("-", "suite timing")
    terminalreporter.write_line(
        f"wall {time.monotonic() - _START[0]:.1f} s (collection included); test time: {fast:.1f} s in "
        f"{len(_TIMES) - n_slow} tests not marked slow (the fast set), {slow:.1f} s in {n_slow} slow tests; "
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
