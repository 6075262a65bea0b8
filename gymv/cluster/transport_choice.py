"""The refit transport a run uses, chosen from where its workers really are (not from the recipe's declared
node count): `refit.transport: auto` takes the fastest that the placement allows, and an explicit transport
that needs one host (shm) or shared GPUs (cuda_ipc) is refused when the actors sit on different nodes.

| placement | auto picks |
|---|---|
| one GPU shared by the sender and every receiver (colocated), not async | cuda_ipc |
| otherwise one node (CPU, several GPUs colocated), not async | shm |
| GPUs not colocated, one generation worker per GPU (any nodes) | nccl |
| anything else (across nodes on a CPU or colocated, async on a CPU) | object_store |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gymv.backends.registry import AUTO_TRANSPORT, REFIT_TRANSPORTS
from gymv.cluster.ray_placement import Seat
from gymv.errors import GymvError


@dataclass(frozen=True)
class Layout:
    gpus: bool
    colocated: bool
    workers_per_gpu: int = 1
    lag_safe: bool = False  # generators may read a refit late (async GRPO): the transport must allow it


def choose_transport(asked: str, senders: Sequence[Seat], receivers: Sequence[Seat], layout: Layout) -> str:
    """The transport to use; raises when an explicit one cannot work across the nodes the actors are on."""
    nodes = {s.node_id for s in (*senders, *receivers) if s.node_id}
    one_node = len(nodes) <= 1
    if asked != AUTO_TRANSPORT:
        t = REFIT_TRANSPORTS.capabilities(asked)
        if (t.single_node_only or t.colocated_only) and not one_node:
            a, b = _apart(senders, receivers)
            raise GymvError(f"refit transport {asked!r} works within one host, but {a.name} is on node {a.node} and "
                            f"{b.name} on node {b.node}", where="refit.transport", exit_code=1,
                            fix="use refit.transport: auto (or nccl / object_store across nodes), or pin both roles to "
                                "one node (cluster.placement)")
        return asked
    if layout.gpus and not layout.colocated and layout.workers_per_gpu == 1:
        return "nccl"
    if one_node and not layout.lag_safe:
        same_gpu = len({s.gpus for s in (*senders, *receivers)}) == 1
        if layout.gpus and layout.colocated and layout.workers_per_gpu == 1 and same_gpu:
            return "cuda_ipc"
        return "shm"
    return "object_store"


def _apart(senders: Sequence[Seat], receivers: Sequence[Seat]) -> tuple[Seat, Seat]:
    """A sender and a receiver (or two of either) on different nodes."""
    everyone = [*senders, *receivers]
    first = everyone[0]
    other = next(s for s in everyone if s.node_id != first.node_id)
    return first, other
