"""A trainer killed with SIGKILL leaves its shm refit segment (a full copy of the weights) behind; the next
shm sender on the host removes it, and never a live trainer's segment. Real processes, real /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gymv.cluster.refit import SHM_PREFIX, make_sender

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory in /dev/shm")

_TRAINER = textwrap.dedent("""
    import sys, time, torch
    from gymv.cluster.refit import make_sender
    sender = make_sender("shm", torch.float32, torch.device("cpu"))
    info = sender.publish({"w": torch.ones(1000)})
    print(info["name"], flush=True)
    time.sleep(600)
""")


def _start_trainers(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(n)]
    out = []
    for proc in procs:
        name = proc.stdout.readline().strip()
        assert name.startswith(SHM_PREFIX) and (Path("/dev/shm") / name).exists()
        out.append((proc, name))
    return out


def test_a_killed_trainers_segment_is_removed_by_the_next_sender_and_a_live_ones_kept():
    (dead, dead_name), (live, live_name) = _start_trainers(2)
    try:
        os.killpg(dead.pid, signal.SIGKILL)  # the trainer and its resource tracker: nothing unlinks the segment
        dead.wait()
        assert (Path("/dev/shm") / dead_name).exists()
        sender = make_sender("shm", torch.float32, torch.device("cpu"))
        try:
            sender.publish({"w": torch.zeros(10)})
            assert not (Path("/dev/shm") / dead_name).exists()
            assert (Path("/dev/shm") / live_name).exists()
        finally:
            sender.close()
    finally:
        os.killpg(live.pid, signal.SIGTERM)
        live.wait()
