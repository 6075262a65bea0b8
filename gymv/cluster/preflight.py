"""Before any worker starts: does the machine (a local cluster) or the joined Ray cluster have what the
recipe asks for? A request it cannot meet stops the launch in seconds with what was asked and what is
there, instead of Ray waiting forever for resources that will never come.

The checks are necessary conditions only (never a refusal of a layout Ray could place): enough nodes,
`gpus_per_node` GPUs on `num_nodes` of them, and for each role (gymv.cluster.roles) nodes that carry its
labels and resources, one that holds its largest bundle, room for all of its bundles on those nodes (on
one of them for STRICT_PACK, one each for STRICT_SPREAD), and room for every role together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gymv.cluster.roles import RolePlan
from gymv.errors import GymvError

NODE_LABEL = "gymv-node"  # the node index label `gymv cluster` gives each node of an allocation (0 = head)
_SET = re.compile(r"^(!?)in\((.*)\)$")


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    resources: dict[str, float]
    labels: dict[str, str]

    @property
    def name(self) -> str:
        """The node as a user finds it: its address, its `gymv-node` index where it has one, a short id."""
        index = self.labels.get(NODE_LABEL)
        return f"{self.address} ({f'node {index}, ' if index is not None else ''}{self.node_id[:8]})"

    def summary(self) -> str:
        cpus, gpus = self.resources.get("CPU", 0), self.resources.get("GPU", 0)
        return f"{cpus:g} CPU{'s' * (cpus != 1)} and " + (f"{gpus:g} GPU{'s' * (gpus != 1)}" if gpus else "no GPU")


def _have(cluster: str, nodes: Sequence[Node]) -> str:
    """`this machine has 2 CPUs and no GPU`; `the Ray cluster at A has 2 nodes: 127.0.0.1 (...) 1 CPU and no GPU; ...`"""
    if not nodes:
        return f"{cluster} has no alive node"
    if len(nodes) == 1 and nodes[0].node_id == "local":
        return f"{cluster} has {nodes[0].summary()}"
    return f"{cluster} has {len(nodes)} node{'s' * (len(nodes) != 1)}: " + "; ".join(f"{n.name} {n.summary()}" for n in nodes)


def machine_node(num_cpus: float, num_gpus: float) -> Node:
    """The one node of a local cluster about to start on this machine."""
    return Node("local", "this machine", {"CPU": float(num_cpus), "GPU": float(num_gpus)}, {})


def ray_nodes() -> list[Node]:
    """The joined cluster's alive nodes, head first."""
    import ray

    out = []
    for n in ray.nodes():
        if n.get("Alive"):
            res = {k: float(v) for k, v in n.get("Resources", {}).items()}
            labels = {k: str(v) for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            out.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), res, labels))
    return sorted(out, key=lambda n: ("node:__internal_head__" not in n.resources, n.labels.get(NODE_LABEL, ""), n.address))


def label_matches(selector: str, value: str | None) -> bool:
    """Ray's label selector values: `v`, `!v`, `in(a,b)`, `!in(a,b)` (a missing label matches only `!`)."""
    m = _SET.match(selector.strip())
    if m:
        negate, allowed = m.group(1) == "!", {v.strip() for v in m.group(2).split(",")}
    else:
        negate, allowed = selector.startswith("!"), {selector.lstrip("!")}
    return (value not in allowed) if negate else (value is not None and value in allowed)


def eligible(plan: RolePlan, nodes: Sequence[Node]) -> list[Node]:
    """Nodes that carry every label and custom resource the role is pinned to."""
    labels, resources = dict(plan.pin.labels), dict(plan.pin.resources)
    return [n for n in nodes if all(label_matches(sel, n.labels.get(k)) for k, sel in labels.items())
            and all(n.resources.get(r, 0) > 0 for r in resources)]


def _fits(bundle: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _sum(resources: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _short(res: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in res.items() if v) or "nothing"


@dataclass(frozen=True)
class Checked:
    """What the recipe's roles ask of a cluster, for the start-up message and the run directory."""

    cluster: str
    nodes: tuple[Node, ...]
    asks: tuple[tuple[str, str], ...]  # (role, what it asks)


def check(cfg, plans: Sequence[RolePlan], nodes: Sequence[Node], *, cluster: str, where: Callable[[str], str],
          recipe: str | None = None) -> Checked:
    """Raise a GymvError for the first request `nodes` cannot meet; `cluster` names them in the message
    ("this machine", "the Ray cluster at HOST:PORT") and `where(key)` points at the recipe line."""
    c = cfg.cluster
    have = _have(cluster, nodes)
    gpu_nodes = [n for n in nodes if n.resources.get("GPU", 0) >= c.gpus_per_node]
    if c.gpus_per_node and not any(n.resources.get("GPU", 0) for n in nodes):
        try_tiny = f"`gymv smoke --tiny {recipe or 'RECIPE'}` runs this recipe's plumbing on the CPU with a tiny model"
        raise GymvError(f"the recipe asks for {c.num_nodes} node{'s' * (c.num_nodes != 1)} x {c.gpus_per_node} GPUs "
                        f"and {have}", where=where("cluster.gpus_per_node"),
                        fix=f"{try_tiny}; or train a CPU recipe (gpus_per_node: 0, e.g. "
                            "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml); or --ray-address of a cluster with GPUs")
    if c.num_nodes > len(nodes):
        raise GymvError(f"the recipe asks for {c.num_nodes} nodes (cluster.num_nodes) and {have}",
                        where=where("cluster.num_nodes"),
                        fix="start Ray on every node (`gymv cluster up` in a SLURM allocation, or `ray start`) and pass "
                            f"--ray-address, or set cluster.num_nodes: {max(1, len(nodes))}")
    if c.gpus_per_node and len(gpu_nodes) < c.num_nodes:
        raise GymvError(f"the recipe asks for {c.num_nodes} nodes of {c.gpus_per_node} GPUs "
                        f"(cluster.num_nodes, cluster.gpus_per_node) and {have}", where=where("cluster.gpus_per_node"),
                        fix="set cluster.gpus_per_node and cluster.num_nodes to what the cluster has, or join a larger one")
    for plan in plans:
        _check_role(plan, nodes, have, where)
    asked = _sum([plan.totals() for plan in plans])
    total = _sum([n.resources for n in nodes])
    short = {k: v for k, v in asked.items() if total.get(k, 0.0) + 1e-9 < v}
    if short:
        raise GymvError(f"the run's roles together ask for {_short(asked)} ({'; '.join(f'{p.role}: {p.describe()}' for p in plans)}) "
                        f"and {have}", where=where("cluster"),
                        fix="lower the GPUs or ranks the roles ask for (cluster.*, mopd.teachers.*.gpus), or join a larger cluster")
    return Checked(cluster, tuple(nodes), tuple((p.role, p.describe()) for p in plans))


def _check_role(plan: RolePlan, nodes: Sequence[Node], have: str, where: Callable[[str], str]) -> None:
    pinned = bool(plan.pin.labels or plan.pin.resources)
    on = eligible(plan, nodes)
    pins = ", ".join([f"label {k}={v}" for k, v in plan.pin.labels] + [f"resource {k}" for k, _ in plan.pin.resources])
    asks = f"{plan.role} ({plan.describe()}{'; pinned to ' + pins if pinned else ''})"
    if pinned and not on:
        raise GymvError(f"{asks}: no node carries {pins}; {have}", where=where(plan.key),
                        fix=f"label the nodes (`ray start --labels`, `gymv cluster`) or change {plan.key}")
    bundles = plan.bundles or plan._pinned_workers()
    if not bundles:
        return
    room = _sum([n.resources for n in on])
    biggest = max(bundles, key=lambda b: sum(b.values()))
    if not any(_fits(biggest, n.resources) for n in on):
        raise GymvError(f"{asks}: no node holds a bundle of {_short(biggest)}; {have}", where=where(plan.size_key),
                        fix="a bundle lives on one node: lower the GPUs per engine or teacher replica, or use larger nodes")
    if not _fits(_sum(bundles), room):
        raise GymvError(f"{asks} needs {_short(_sum(bundles))} in all; {have}", where=where(plan.size_key),
                        fix="ask for fewer GPUs or ranks (cluster.*), or join a larger cluster")
    if plan.strategy == "STRICT_PACK" and plan.bundles and not any(_fits(_sum(bundles), n.resources) for n in on):
        raise GymvError(f"{asks}: STRICT_PACK needs every bundle on one node; {have}", where=where(plan.key),
                        fix=f"use strategy PACK in {plan.key}")
    if plan.strategy == "STRICT_SPREAD" and plan.bundles and len(bundles) > len(on):
        raise GymvError(f"{asks}: STRICT_SPREAD needs a node per bundle, {len(on)} qualify; {have}",
                        where=where(plan.key), fix=f"use strategy SPREAD in {plan.key}")
