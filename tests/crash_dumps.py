"""Python stacks of a test process that dies on a fatal signal, kept in a file (tests/conftest.py loads this
plugin; it does nothing unless GYMV_TEST_CRASH_DIR names a folder, as scripts/test.sh does).

Why: a pytest-xdist worker that aborts mid-test (CI saw SIGABRT in a worker driving a local Ray, right after a
test's actors were killed) leaves only "node down: Not properly terminated" in the log. What it wrote to stderr
went into pytest's capture file, which dies with it, and no faulthandler dump reached the log either: once Ray
has been stopped and started again in a process (test modules do, between them), a fatal signal no longer
reaches faulthandler's handler (Ray's own handlers, installed anew, do not lead to it), and a library may also
point faulthandler at pytest's capture (Ray turns it on, on the stderr of the moment, when it finds it off).
Here each test process installs faulthandler afresh, with every thread's stack, on a file of its own in that
folder at the start of each phase of each test (setup, call, teardown); scripts/test.sh prints the files it
finds after the run. Ray's own note of the signal in its session log may be lost in exchange.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path
from typing import IO

import pytest

ENV = "GYMV_TEST_CRASH_DIR"
_FILE: list[IO] = []


def crash_file(config: pytest.Config) -> Path | None:
    """This process's dump file under GYMV_TEST_CRASH_DIR: one per process, named after the xdist worker."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    return Path(folder) / f"{worker}-{os.getpid()}.txt"


def _arm() -> None:
    """faulthandler's handlers installed afresh, on this process's file: enable() alone only changes the file,
    and Ray's signal handlers, installed again when Ray starts again in this process, no longer lead to them."""
    if _FILE:
        faulthandler.disable()
        faulthandler.enable(file=_FILE[0], all_threads=True)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    path = crash_file(config)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _FILE.append(open(path, "w"))  # noqa: SIM115 (open for the process's life: the handler writes to its fd)
    _arm()


def pytest_runtest_setup(item: pytest.Item) -> None:
    _arm()


def pytest_runtest_call(item: pytest.Item) -> None:
    _arm()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _arm()


@pytest.hookimpl(tryfirst=True)  # before pytest's own faulthandler plugin restores the handler it found
def pytest_unconfigure(config: pytest.Config) -> None:
    """A process that ends normally leaves no file behind (an empty one says nothing)."""
    if not _FILE:
        return
    f = _FILE.pop()
    faulthandler.disable()
    f.close()
    if os.path.getsize(f.name) == 0:
        os.unlink(f.name)
