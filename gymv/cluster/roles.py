"""What each role of a run asks Ray for: its placement group's bundles and strategy, its node pins, and the
bundle (and GPUs) each of its workers takes. Plain arithmetic over a Placement: the pre-flight check
(gymv.cluster.preflight) and the actors' placement (gymv.cluster.group, gymv.cluster.teachers) read the same
plans, so what is checked before Ray starts is what is asked of it afterwards.

Roles: `generation` and `training` on separate GPUs (or on a CPU); `policy` when colocated (generation and
training share one bundle per GPU, and colocated MOPD teachers join it); `teacher <alias>` for a MOPD
teacher on GPUs of its own. A bundle is what Ray keeps on one node, so a vLLM engine spanning several GPUs
(tensor parallel) takes one bundle of that many GPUs, and so does each tensor-parallel group of training
ranks on separate GPUs: neither is ever split across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gymv.cluster.placement import Pin, Placement

ROLE_KEYS = {"generation": "cluster.placement.generation", "training": "cluster.placement.training",
             "policy": "cluster.placement.training", "teacher": "cluster.placement.teachers"}


@dataclass(frozen=True)
class Slot:
    """Where one worker sits: a bundle of its role's placement group (None: no group, a CPU worker that
    reserves nothing) and the GPUs it takes there."""

    bundle: int | None
    gpus: float = 0.0


@dataclass(frozen=True)
class RolePlan:
    role: str  # generation | training | policy | teacher <alias>
    bundles: tuple[dict[str, float], ...]  # empty: no placement group
    strategy: str
    pin: Pin = Pin()
    workers: dict[str, tuple[Slot, ...]] = field(default_factory=dict)  # kind of worker -> its slots

    @property
    def key(self) -> str:
        """The recipe key that places the role (strategy, labels, resources)."""
        return ROLE_KEYS[self.role.split()[0]]

    @property
    def size_key(self) -> str:
        """The recipe key that sizes the role (how many GPUs or ranks it asks for)."""
        kind, *alias = self.role.split()
        gpus = any("GPU" in b for b in self.bundles)
        if kind == "teacher":
            return f"mopd.teachers.{alias[0]}.gpus" if gpus else f"mopd.teachers.{alias[0]}.data_parallel_size"
        if kind == "policy":
            return "cluster.gpus_per_node"
        if kind == "training":
            return "cluster.training_gpus" if gpus else "cluster.cpu_training_ranks"
        return "cluster.generation_gpus" if gpus else "cluster.generation_workers_per_gpu"

    def totals(self) -> dict[str, float]:
        """Resources of all bundles together (of the pinned workers, for a role without a group)."""
        out: dict[str, float] = {}
        for b in self.bundles or self._pinned_workers():
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def _pinned_workers(self) -> list[dict[str, float]]:
        return [dict(self.pin.resources)] * sum(len(s) for s in self.workers.values())

    def describe(self) -> str:
        """`8 bundles of {GPU: 1, CPU: 1}, PACK` (what a user reads in errors and the placement summary)."""
        if not self.bundles:
            n = sum(len(s) for s in self.workers.values())
            return f"{n} worker{'s' * (n != 1)} reserving {_res(dict(self.pin.resources)) if self.pin.resources else 'nothing'}"
        kinds = sorted({_res(b) for b in self.bundles})
        shape = kinds[0] if len(kinds) == 1 else " / ".join(kinds)
        return f"{len(self.bundles)} bundle{'s' * (len(self.bundles) != 1)} of {shape}, {self.strategy}"


def _res(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def _bundle(gpus: float, cpus: float, pin: Pin) -> dict[str, float]:
    out = {"GPU": float(gpus)} if gpus else {}
    return {**out, "CPU": float(cpus), **dict(pin.resources)}


def policy_plans(p: Placement, *, generation: bool = True, gpu_share: float = 0.5) -> list[RolePlan]:
    """The generation and training roles of `p` (one `policy` role when colocated on GPUs)."""
    n_gen = p.num_generation if generation else 0
    if p.gpus == 0:
        return [_cpu_generation(p, n_gen), _cpu_training(p)]
    if p.colocated:
        bundles = (_bundle(1, 1, p.training_pin),) * p.gpus
        workers = {"training": tuple(Slot(r % p.gpus, gpu_share) for r in range(p.num_training)),
                   "generation": tuple(Slot(e % p.gpus, gpu_share / p.generation_per_gpu) for e in range(n_gen))}
        return [RolePlan("policy", bundles, p.training_pin.strategy or "PACK", p.training_pin, workers)]
    return [_gpu_generation(p, n_gen), _gpu_training(p)]


def _cpu_generation(p: Placement, n: int) -> RolePlan:
    return RolePlan("generation", (), p.generation_pin.strategy or "PACK", p.generation_pin,
                    {"generation": (Slot(None),) * n})


def _cpu_training(p: Placement) -> RolePlan:
    """One CPU bundle per rank, spread over the nodes, when there are several of each; else no group."""
    pin, n = p.training_pin, p.num_training
    if p.nodes > 1 and n > 1:
        return RolePlan("training", (_bundle(0, 1, pin),) * n, pin.strategy or "SPREAD", pin,
                        {"training": tuple(Slot(r) for r in range(n))})
    return RolePlan("training", (), pin.strategy or "PACK", pin, {"training": (Slot(None),) * n})


def _gpu_generation(p: Placement, n: int) -> RolePlan:
    pin, tp, k = p.generation_pin, p.generation_tp, p.generation_per_gpu
    if tp > 1:  # one bundle per engine: its tensor-parallel GPUs on one node
        bundles, slots = (_bundle(tp, 1, pin),) * n, tuple(Slot(e, tp) for e in range(n))
    else:
        bundles = (_bundle(1, 1, pin),) * -(-n // k)
        slots = tuple(Slot(e // k, 1 / k) for e in range(n))
    return RolePlan("generation", bundles, pin.strategy or "PACK", pin, {"generation": slots})


def _gpu_training(p: Placement) -> RolePlan:
    pin, n = p.training_pin, p.num_training
    tp = p.trainer_mesh.tensor
    if tp > 1:  # one bundle per tensor-parallel group (ranks r..r+tp-1): the group never spans nodes
        bundles = (_bundle(tp, tp, pin),) * (n // tp)
        slots = tuple(Slot(r // tp, 1) for r in range(n))
    else:
        bundles, slots = (_bundle(1, 1, pin),) * n, tuple(Slot(r, 1) for r in range(n))
    return RolePlan("training", bundles, pin.strategy or "PACK", pin, {"training": slots})


def teacher_ranks(teacher) -> int:
    """Processes per replica of a teacher: its tensor-parallel size for a backend that runs one rank per
    device (megatron), else 1 (one process drives every GPU of the replica: vllm)."""
    from gymv.backends.registry import TEACHER_BACKENDS

    caps = TEACHER_BACKENDS.capabilities(teacher.backend)
    return teacher.tensor_parallel_size if caps.rank_per_device else 1


def teacher_plan(alias: str, teacher, pin: Pin, *, gpus_per_node: int) -> RolePlan | None:
    """A teacher's own role: on a CPU its replicas reserve nothing; on GPUs with `placement: separate` one
    bundle of `gpus / data_parallel_size` GPUs per replica. None for a colocated teacher on GPUs (it joins
    the policy's bundles). A replica of several ranks (`teacher_ranks`) has one worker per rank, replica by
    replica, each rank with one GPU of its replica's bundle."""
    dp, ranks = teacher.data_parallel_size, teacher_ranks(teacher)
    role = f"teacher {alias}"
    if gpus_per_node == 0:
        return RolePlan(role, (), pin.strategy or "PACK", pin, {"teacher": (Slot(None),) * (dp * ranks)})
    if teacher.placement == "colocated":
        return None
    per = (teacher.gpus or dp) // dp
    return RolePlan(role, (_bundle(per, ranks, pin),) * dp, pin.strategy or "PACK", pin,
                    {"teacher": tuple(Slot(r // ranks, per / ranks) for r in range(dp * ranks))})


def run_plans(cfg, placement: Placement | None = None) -> list[RolePlan]:
    """Every role of the recipe `cfg`: the policy's, then each MOPD teacher's own."""
    p = placement or Placement.from_config(cfg)
    plans = policy_plans(p)
    mopd = getattr(cfg, "mopd", None)
    if mopd is not None:
        pin = Pin.from_section(cfg.cluster.placement.teachers)
        for alias, t in mopd.teachers.items():
            plan = teacher_plan(alias, t, pin, gpus_per_node=cfg.cluster.gpus_per_node)
            if plan is not None:
                plans.append(plan)
    return plans
