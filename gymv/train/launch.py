"""The parts of a launch around the training loop: the resource pre-flight before Ray starts (or right after
joining a cluster, before any worker starts), the placement the run got, and automatic restarts after a
lost node or worker (`gymv train --max-restarts N`, `cluster.max_restarts`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from gymv.cluster.preflight import Checked, check, machine_node, ray_nodes
from gymv.cluster.ray_placement import LOST_EXIT
from gymv.cluster.roles import run_plans
from gymv.errors import GymvError


def ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def check_machine(cfg, where: Callable[[str], str], recipe: str | None) -> tuple[Checked, int]:
    """Before a local cluster starts: the recipe against this machine's CPUs and GPUs (the check, its GPUs)."""
    gpus = local_gpu_count()
    cpus = os.cpu_count() or 1
    return check(cfg, run_plans(cfg), [machine_node(cpus, gpus)], cluster="this machine", where=where,
                 recipe=recipe), gpus


def check_joined(cfg, address: str, where: Callable[[str], str], recipe: str | None) -> Checked:
    """Right after joining a cluster, before any worker starts: the recipe against its alive nodes."""
    return check(cfg, run_plans(cfg), ray_nodes(), cluster=f"the Ray cluster at {address}", where=where, recipe=recipe)


def wait_for_nodes(count: int, deadline_s: float, say: Callable[[str], None], lost: str | None = None) -> None:
    """After a lost node: wait (at most `deadline_s`) until Ray has marked the `lost` node dead (so nothing is
    placed on it again) and the joined cluster has `count` alive nodes (a scheduler replacing the node),
    so the restart's pre-flight sees the cluster as it is."""
    import ray

    def ready() -> bool:
        nodes = ray.nodes()
        gone = lost is None or not any(n["NodeID"] == lost and n.get("Alive") for n in nodes)
        return gone and sum(1 for n in nodes if n.get("Alive")) >= count

    if ready():
        return
    say(f"waiting up to {deadline_s:g} s for Ray to drop the lost node and have {count} alive nodes")
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not ready():
        time.sleep(1.0)


def with_restarts(run_once: Callable[[str | None, GymvError | None], dict], *, max_restarts: int,
                  say: Callable[[str], None]) -> dict:
    """Run `run_once(resume_dir, after)`; after a lost node or worker (exit code LOST_EXIT) run it again on the
    run directory it wrote, which resumes from its newest complete checkpoint, at most `max_restarts` times
    (`after` is the error that stopped the previous launch)."""
    resume_dir: str | None = None
    after: GymvError | None = None
    restarts = 0
    while True:
        try:
            return run_once(resume_dir, after)
        except GymvError as e:
            run_dir = getattr(e, "run_dir", None)
            if e.exit_code != LOST_EXIT or restarts >= max_restarts or run_dir is None:
                if e.exit_code == LOST_EXIT and restarts:
                    raise GymvError(f"{e.message} (after {restarts} restart{'s' * (restarts != 1)})", where=e.where,
                                    fix=e.fix, exit_code=e.exit_code) from None
                raise
            restarts += 1
            resume_dir, after = run_dir, e
            say(f"restart {restarts}/{max_restarts} after: {e.message}; resuming {run_dir} from its newest complete "
                "checkpoint")
