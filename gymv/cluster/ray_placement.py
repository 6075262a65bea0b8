"""A role's plan (gymv.cluster.roles) turned into Ray: its placement group, each worker's actor options, and
a roster of where every actor landed, which names the node, role and rank of a worker that is lost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gymv.cluster.roles import RolePlan, Slot
from gymv.errors import GymvError


def place(plan: RolePlan, deadline_s: float):
    """The role's placement group, ready (None for a role without bundles)."""
    pg = group_for(plan)
    if pg is not None:
        wait_placed(pg, plan, deadline_s)
    return pg


def group_for(plan: RolePlan):
    """The role's placement group, asked for and not yet waited on (None for a role without bundles)."""
    if not plan.bundles:
        return None
    from ray.util.placement_group import placement_group

    selector = [dict(plan.pin.labels)] * len(plan.bundles) if plan.pin.labels else None
    return placement_group([dict(b) for b in plan.bundles], strategy=plan.strategy, bundle_label_selector=selector)


def wait_placed(pg, plan: RolePlan, deadline_s: float) -> None:
    """Wait at most `deadline_s` for `pg`: an unmet request is an error naming the role and what it asked
    (the group is removed), never a silent wait."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(pg.ready(), timeout=deadline_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        raise GymvError(f"Ray could not place {plan.role} ({plan.describe()}) within {deadline_s:g} s: the cluster "
                        "has too few free resources on nodes that qualify (`ray status` shows what is in use)",
                        where=plan.key, exit_code=1,
                        fix="free the resources, ask for fewer (cluster.*), or raise cluster.placement_timeout_s") from None


def actor_options(plan: RolePlan, slot: Slot, pg, base: dict | None = None) -> dict:
    """Ray actor options of the worker at `slot`: its bundle of `pg`, or (no group) the role's node pins."""
    opts = {"num_cpus": 0, **(base or {})}
    if pg is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundle)
        if slot.gpus:
            opts["num_gpus"] = slot.gpus
        return opts
    if plan.pin.labels:
        opts["label_selector"] = dict(plan.pin.labels)
    if plan.pin.resources:
        opts["resources"] = dict(plan.pin.resources)
    return opts


def here() -> dict:
    """Where the calling actor runs: its Ray node, that node's address, its GPUs."""
    import ray

    ctx = ray.get_runtime_context()
    try:
        address = ray.util.get_node_ip_address()
    except Exception:
        address = "127.0.0.1"
    return {"node_id": ctx.get_node_id(), "address": address, "pid": os.getpid(),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


@dataclass
class Seat:
    """One actor of the run: its role and rank, and where it runs once known."""

    role: str
    rank: int
    node_id: str = ""
    address: str = ""
    pid: int = 0
    gpus: str = ""

    @property
    def name(self) -> str:
        return f"{self.role} {'rank' if self.role == 'training' else 'worker'} {self.rank}"

    @property
    def node(self) -> str:
        return f"{self.address} ({self.node_id[:8]})" if self.node_id else "an unknown node"


@dataclass
class Roster:
    """actor id -> Seat, for every actor a cluster started."""

    seats: dict[str, Seat] = field(default_factory=dict)

    def add(self, actor, role: str, rank: int) -> None:
        self.seats[actor._actor_id.hex()] = Seat(role, rank)

    def locate(self, actors, wheres: list[dict]) -> None:
        for a, w in zip(actors, wheres):
            seat = self.seats.get(a._actor_id.hex())
            if seat is not None:
                seat.node_id, seat.address, seat.pid, seat.gpus = w["node_id"], w["address"], w["pid"], w["gpus"]

    def drop(self, actor) -> None:
        self.seats.pop(actor._actor_id.hex(), None)

    def by_node(self) -> dict[str, list[Seat]]:
        out: dict[str, list[Seat]] = {}
        for s in self.seats.values():
            out.setdefault(s.node, []).append(s)
        return out


ROSTER = Roster()  # every actor of this driver's run, whichever cluster object started it


def lost_worker_error(e, phase: str) -> GymvError:
    """What a RayActorError means for the run: which worker, on which node, whether the node itself is gone,
    and a memory hint only when Ray says the process was killed for memory."""
    seat = ROSTER.seats.get(getattr(e, "actor_id", None) or "")
    text = str(e)
    who = f"{seat.name} on node {seat.node}" if seat else "a worker"
    failed = creation_error(e, seat.name if seat else "a worker")
    if failed is not None:
        return failed
    if seat and seat.node_id and ("node has died" in text or "node died" in text or not _node_alive(seat.node_id)):
        cause = f"node {seat.node} was lost"
        fix = "the run resumes from its newest complete checkpoint with --max-restarts N (cluster.max_restarts)"
    elif any(m in text for m in _OOM_MARKS):
        cause = "Ray killed it for running out of memory"
        fix = "lower the batch sizes or training.micro_batch_tokens, or give the node more memory"
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("\t")]
        cause = f"its process ended ({lines[-1] if lines else 'no reason given'})"
        fix = "run with --debug for Ray's message; --max-restarts N resumes from the newest complete checkpoint"
    err = GymvError(f"{who} died during {phase}: {cause}", where=phase, fix=fix, exit_code=LOST_EXIT)
    err.lost_node = seat.node_id if seat and cause.startswith("node") else None
    return err


def creation_error(e, who: str) -> GymvError | None:
    """The error an actor's `__init__` raised, when that is why it died (Ray's `actor_init_failed`), else None.

    Such a worker did not lose its node or process: the same launch fails the same way again (a teacher with
    another vocabulary, a checkpoint that does not match its config), so it is reported as itself and is never
    restarted. A GymvError keeps its line (Ray passes the creation task's error on as text: its last line is
    `gymv.errors.GymvError: <the error's line>`); anything else is named with its type."""
    if not getattr(e, "actor_init_failed", False):
        return None
    cause = getattr(getattr(e, "creation_task_error", None), "cause", None)  # where Ray keeps the exception
    if isinstance(cause, GymvError):
        return type(cause)(cause.message, where=cause.where, fix=cause.fix, exit_code=cause.exit_code)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    last = lines[-1] if lines else ""
    kind, _, said = last.partition(": ")
    if kind.startswith("gymv.") and said:
        message, _, fix = said.partition(" (fix: ")
        return GymvError(message, fix=fix[:-1] if fix.endswith(")") else (fix or None))
    reason = " ".join(last.split()) or "no reason given"
    return GymvError(f"{who} failed to start: {reason[:300]}", exit_code=1,
                     fix="run with --debug for the worker's traceback; a failure to start is not a lost node, so the "
                         "run is not restarted")


def deferred_start(cls: type) -> type:
    """`cls` for `ray.remote`, with its constructor's error kept and raised by each later call instead.

    An actor whose `__init__` raises dies, and Ray prints that error's whole traceback from the worker's
    stderr onto the driver's, beside gymv's one-line error (and sometimes after it). A method's error is
    only returned to the caller, which `ray_get` turns into one line (a GymvError as itself; never a lost
    worker). So the constructor's error waits in the object, and the first call (the launch asks every
    worker where it runs) raises it."""
    import functools
    import inspect

    def guarded(fn):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def call(self, *args, **kwargs):
                if self._start_error is not None:
                    raise self._start_error
                return await fn(self, *args, **kwargs)
        else:
            @functools.wraps(fn)
            def call(self, *args, **kwargs):
                if self._start_error is not None:
                    raise self._start_error
                return fn(self, *args, **kwargs)
        return call

    def __init__(self, *args, **kwargs):
        self._start_error = None
        try:
            cls.__init__(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised again by the next call
            e.__traceback__ = None  # the frames (and what they hold: a half-loaded model) are not kept
            self._start_error = e

    methods = {name: guarded(fn) for name, fn in inspect.getmembers(cls, inspect.isfunction)
               if not name.startswith("_")}
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, **methods})


# what Ray writes when its memory monitor killed the worker (not its generic "a process died" hints)
_OOM_MARKS = ("NODE_OUT_OF_MEMORY", "killed due to memory pressure", "running low on memory", "OutOfMemoryError")
LOST_EXIT = 75  # a worker or node was lost (EX_TEMPFAIL): a restart may succeed where the run stopped


def _node_alive(node_id: str) -> bool:
    """Whether the node still runs: the head says so and its raylet still answers on its port (the head
    itself notices a dead node only after several missed health checks)."""
    import socket

    import ray

    for n in ray.nodes():
        if n["NodeID"] == node_id:
            if not n["Alive"]:
                return False
            try:
                with socket.create_connection((n["NodeManagerAddress"], int(n["NodeManagerPort"])), timeout=3):
                    return True
            except (OSError, KeyError, ValueError):
                return False
    return False
