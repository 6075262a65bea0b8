"""Leaving a torch.distributed group cleanly.

gloo runs collectives on its own C++ threads. A rank that tears its group down while a peer still has work in
flight on those threads can abort the whole process ("terminate called without an active exception") at exit,
after every step has succeeded. Meeting at a barrier first makes every rank's collectives finish before any
rank destroys its group.
"""

from __future__ import annotations

import datetime


def leave_process_group(timeout_s: float = 60.0) -> bool:
    """Destroy the default group after the ranks meet; a peer that never arrives (it crashed, or its own
    leaving was not started: every rank must be asked at once) costs `timeout_s`, not a hang. Whether the
    ranks met."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    met = True
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            met = False
    dist.destroy_process_group()
    return met
