"""End a local Ray cluster's processes when the driver that started it dies without shutting it down.

Ray ties its head processes to the driver, but not the processes they start: after a driver SIGKILL (an
OOM kill, a scheduler's preemption) the dashboard and runtime-env agents and idle workers live on for a
minute or more, still listening. A small watcher process, started beside the cluster, records the
driver's descendants every second; when the driver is gone (its end of a pipe closes) it stops the ones
that are still running (same pid and start time: never a recycled pid), TERM first, then KILL.

    python -m gymv.cluster.reaper DRIVER_PID     (stdin: a pipe the driver holds open)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_S = 1.0
GRACE_S = 3.0
DONE = b"done"


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below `root` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
                starts[int(name)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out and pid in starts:
            out[pid] = starts[pid]
            todo += children.get(pid, [])
    return out


def _signal_all(procs: dict[int, int], sig: int) -> int:
    alive = 0
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            alive += 1
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return alive


def watch(driver: int, pipe) -> None:
    me = os.getpid()
    seen: dict[int, int] = {}
    while True:
        seen.update({p: s for p, s in descendants(driver).items() if p != me})
        ready, _, _ = select.select([pipe], [], [], POLL_S)
        if ready:
            said = os.read(pipe.fileno(), 4096)
            if said.startswith(DONE):
                return  # a clean shutdown: Ray stopped its own processes
            if not said:
                break  # the driver is gone without a word
    if not _signal_all(seen, signal.SIGTERM):
        return
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _signal_all(seen, 0):
        time.sleep(0.1)
    _signal_all(seen, signal.SIGKILL)


def stop_reaper(proc: subprocess.Popen | None) -> None:
    """A clean shutdown: the watcher leaves everything alone and exits."""
    if proc is None:
        return
    try:
        proc.stdin.write(DONE)
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def start_reaper() -> subprocess.Popen | None:
    """The watcher for this process's local cluster (Linux only; None elsewhere). Keep the returned
    object referenced: its stdin is the pipe whose closing says the driver is gone."""
    if not os.path.isdir("/proc/self"):
        return None
    return subprocess.Popen([sys.executable, "-m", "gymv.cluster.reaper", str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver's group is not for us
    watch(int(sys.argv[1]), sys.stdin)
