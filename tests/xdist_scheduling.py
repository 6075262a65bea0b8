"""A `--dist loadfile` scheduler for pytest-xdist that survives a crashed worker (tests/conftest.py loads this
plugin; without pytest-xdist, or without `-n`, nothing calls its hook and it does nothing).

Why: pytest-xdist 3.8's file scheduler, when a worker dies, puts every file that worker had ever been given back
on the queue, the files it had already finished included. A replacement worker handed such a finished file gets
an empty batch: no test of it ever completes, so the scheduler is never asked for more work, and the run waits
forever once the other worker is done (seen on CI as "node down: Not properly terminated", then a hang until the
job's own limit). The replacement worker is also given a single file when it joins, and a worker holds back its
last test until it is sent more or told to stop (it must know the next test to tear down the module's fixtures):
a one-test file is never run, and again nothing completes. And the test the worker died in runs a second time,
though it was already reported failed. Here a crash puts back only the files with tests still to run and counts
the test the worker died in as done (it fails once), and a worker is always handed enough to go on: files until
it holds more than two tests, and the order to stop once the queue is empty. Work sent to a worker that has
died but whose last reports are still being read (the send fails) is kept as its own, so that its removal
queues it again, rather than ending the run with an internal error.
"""

from __future__ import annotations

from typing import Any

import pytest


def _scheduler_class() -> type:
    from xdist.scheduler import LoadFileScheduling

    class CrashSafeLoadFileScheduling(LoadFileScheduling):
        """LoadFileScheduling that re-queues only the unfinished files of a crashed worker and never leaves a worker
        waiting on a file it cannot start."""

        def remove_node(self, node: Any) -> str | None:
            """Forget `node`; if it died with tests pending, return the test it died in (reported failed by the
            controller), counted as done, and queue again the files that still have tests to run."""
            workload = self.assigned_work.pop(node)
            crashitem = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done),
                             None)
            if crashitem is None:
                return None
            workload[self._split_scope(crashitem)][crashitem] = True
            for scope, unit in workload.items():
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node: Any) -> None:
            """Hand `node` files until it holds more than two pending tests; tell it to stop when none are left.
            A node whose process already died (its last reports still arriving) keeps what it was handed: its
            removal puts that back on the queue."""
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                try:
                    self._assign_work_unit(node)
                except OSError:  # execnet: "cannot send (already closed?)"
                    return
            if not self.workqueue:
                node.shutdown()

    return CrashSafeLoadFileScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The crash-safe scheduler for `--dist loadfile`; any other mode is left to pytest-xdist."""
    if config.getvalue("dist") != "loadfile":
        return None
    return _scheduler_class()(config, log)
