"""MOPD teachers: Ray actors that score the student's tokens, one group of replicas per teacher alias.

A teacher is a frozen checkpoint that shares the student's tokenizer: a vision-language model (it sees the
row's images) or a text-only causal LM (it never receives an image argument). Each alias runs
`data_parallel_size` replicas; the driver pads an alias's rows to a multiple of that size by repeating whole
rows (gymv.algorithms.teacher_batch), gives each replica an equal contiguous shard, and drops the padding
scores afterwards.

Placement:
- CPU (`gpus_per_node: 0`): every replica is its own actor reserving no CPUs (as the policy workers do:
  the phases of a synchronous step alternate).
- GPUs, `placement: colocated`: replica r shares bundle r of the policy's placement group (a third of the
  GPU beside the generation and training workers).
- GPUs, `placement: separate`: a placement group of its own with `gpus` GPUs, `gpus / data_parallel_size`
  per replica, pinned by `cluster.placement.teachers` (gymv.cluster.roles).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gymv.algorithms.teacher_batch import pad_rows, shard_rows, trim
from gymv.backends.registry import TEACHER_BACKENDS
from gymv.backends.teacher_spec import TeacherSpec
from gymv.cluster.device_memory import phase_memory
from gymv.cluster.placement import Deadlines, Pin
from gymv.cluster.ray_placement import ROSTER, actor_options, deferred_start, group_for, here, wait_placed
from gymv.cluster.roles import RolePlan, teacher_plan, teacher_ranks
from gymv.errors import GymvError
from gymv.models.init_path import resolve_init_path
# the workers (torch) load in the teacher actors only: `gymv train` resolves teacher_specs here before Ray starts

TEXT_PREFIX = "text:"  # a teacher path `text:<checkpoint>` scores with that VLM's language model alone


class TeacherWorker:
    """One replica of one teacher, or one rank of a replica of several (a Ray actor through `ray.remote`;
    plain class in tests). A single-rank replica builds its scorer at once; the ranks of a larger one build
    theirs in `join`, once their process group is up (rank 0 serves its rendezvous: `address`)."""

    def __init__(self, spec: TeacherSpec, replica: int = 0, rank: int = 0, world_size: int = 1):
        from gymv.cluster.workers import _device, _set_threads

        _set_threads(spec.threads)
        self.spec, self.replica, self.rank, self.world_size = spec, replica, rank, world_size
        self.device = _device(spec)  # type: ignore[arg-type]  (reads .device only)
        self.teacher = None
        if world_size == 1:
            self._build()

    def _build(self) -> None:
        scorer = TEACHER_BACKENDS.load(self.spec.section.backend)
        device = str(self.device)
        self.teacher = scorer(self.spec if device == self.spec.device else _with_device(self.spec, device))

    def address(self) -> tuple[str, int]:
        """(host, port) of the replica's rendezvous store, which its rank 0 (asked this) serves on the node's
        address only."""
        import ray.util

        from gymv.net import master_store

        try:
            host = ray.util.get_node_ip_address()
        except Exception:
            host = "127.0.0.1"
        self._store, self._listener = master_store(host, self.world_size)
        return host, self._store.port

    def join(self, master: tuple[str, int]) -> None:
        """Join the replica's process group (nccl on GPUs, gloo on a CPU) and build this rank's scorer."""
        import torch.distributed as dist

        store = getattr(self, "_store", None)
        if store is None:
            store = dist.TCPStore(master[0], master[1], world_size=self.world_size, is_master=False)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store, rank=self.rank,
                                world_size=self.world_size)
        self._build()

    def info(self) -> dict:
        count = getattr(self.teacher, "num_parameters", None)  # a teacher without a torch module here says it
        parameters = count() if count is not None else sum(p.numel() for p in self.teacher.model.parameters())
        return {"alias": self.spec.alias, "replica": self.replica, "rank": self.rank,
                "text_only": self.teacher.text_only, "parameters": parameters}

    def score(self, rows) -> dict:
        t0 = time.perf_counter()
        scores = self.teacher.score(rows)
        if self.spec.section.placement == "colocated":  # its activations' blocks go back to the shared GPU
            phase_memory(self.device, "teacher", release=True)
        return {"logprobs": scores, "seconds": time.perf_counter() - t0}

    def where(self) -> dict:
        return here()

    def close(self) -> None:
        close = getattr(self.teacher, "close", None)
        if close is not None:
            close()
        if self.world_size > 1:
            from gymv.backends.training.process_group import leave_process_group

            leave_process_group()


def _with_device(spec: TeacherSpec, device: str) -> TeacherSpec:
    from dataclasses import replace

    return replace(spec, device=device)


# ---------------------------------------------------------------------------------------------- driver


def teacher_specs(cfg, student_path: str) -> dict[str, TeacherSpec]:
    """One spec per alias from a validated MOPD config; a backend not wired here is an error naming it."""
    gpu = cfg.cluster.gpus_per_node > 0
    out = {}
    for alias, t in cfg.mopd.teachers.items():
        if t.backend not in TEACHER_BACKENDS:
            raise GymvError(f"teacher {alias!r} uses backend {t.backend!r}, which gymv train does not run yet",
                            where=f"mopd.teachers.{alias}.backend", fix=f"use one of: {', '.join(TEACHER_BACKENDS.available())}")
        text_of = t.path.startswith(TEXT_PREFIX)
        path = resolve_init_path(t.path[len(TEXT_PREFIX):] if text_of else t.path, where=f"mopd.teachers.{alias}.path")
        dtype = "bfloat16" if gpu and cfg.training.dtype in ("auto", "bfloat16") else "float32"
        out[alias] = TeacherSpec(alias=alias, path=path, text_of=text_of, student_path=student_path,
                                 device="cuda" if gpu else "cpu",
                                 dtype=dtype, temperature=cfg.generation.temperature,
                                 max_tokens=cfg.training.micro_batch_tokens, seed=cfg.seed, top_k=cfg.mopd.top_k,
                                 trust_remote_code=cfg.model.trust_remote_code, section=t)
    return out


def replica_options(cfg, alias: str, *, policy_pg=None) -> tuple[list[dict], object | None]:
    """(Ray actor options of each replica of `alias`, a placement group created for it or None); the group
    is asked for here and waited on by the caller."""
    from gymv.cluster.ray_cluster import cpu_actor_options

    t = cfg.mopd.teachers[alias]
    plan = teacher_plan(alias, t, Pin.from_section(cfg.cluster.placement.teachers),
                        gpus_per_node=cfg.cluster.gpus_per_node)
    if plan is not None:
        pg = group_for(plan)
        base = {} if pg is not None else cpu_actor_options()
        return [actor_options(plan, s, pg, base) for s in plan.workers["teacher"]], pg
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if policy_pg is None:
        raise GymvError(f"teacher {alias!r} is colocated, but generation and training do not share GPUs here "
                        f"(cluster.colocated: false)", where=f"mopd.teachers.{alias}.placement",
                        fix="use placement: separate with gpus, or cluster.colocated: true")
    bundles = policy_pg.bundle_count
    return [{"num_cpus": 0, "num_gpus": COLOCATED_SHARE,
             "scheduling_strategy": PlacementGroupSchedulingStrategy(policy_pg, placement_group_bundle_index=r % bundles)}
            for r in range(t.data_parallel_size)], None


COLOCATED_SHARE = 0.3  # of a policy bundle's GPU; generation and training take the rest


class TeacherPool:
    """Every teacher's replicas; `score` fans each alias's rows out to its replicas in one round trip."""

    def __init__(self, cfg, specs: dict[str, TeacherSpec], *, policy_pg=None):
        import ray

        self.specs = specs
        self.deadlines = Deadlines.from_config(cfg.cluster)
        self.dp = {a: cfg.mopd.teachers[a].data_parallel_size for a in self.specs}
        self.replicas: dict[str, list] = {}  # alias -> every replica's first rank (the one whose scores count)
        self.ranks: dict[str, list[list]] = {}  # alias -> each replica's ranks, the first one first
        self._pgs = []
        Worker = ray.remote(deferred_start(TeacherWorker))  # a teacher that cannot start says why in one line
        try:
            self._start(cfg, Worker, policy_pg)
        except BaseException:  # nothing of a pool that failed to start outlives it
            self.shutdown()
            raise

    def _start(self, cfg, Worker, policy_pg) -> None:
        from gymv.cluster.group import ray_get

        for alias, spec in self.specs.items():
            opts, pg = replica_options(cfg, alias, policy_pg=policy_pg)
            if pg is not None:  # a group that is not placed in time is removed by wait_placed
                wait_placed(pg, RolePlan(f"teacher {alias}", tuple(pg.bundle_specs), "PACK"), self.deadlines.placement_s)
                self._pgs.append(pg)
            n = teacher_ranks(cfg.mopd.teachers[alias])
            actors = [Worker.options(**o).remote(spec, i // n, i % n, n) for i, o in enumerate(opts)]
            self.ranks[alias] = [actors[i:i + n] for i in range(0, len(actors), n)]
            self.replicas[alias] = [ranks[0] for ranks in self.ranks[alias]]
            for i, w in enumerate(actors):
                ROSTER.add(w, f"teacher {alias}" + (f" rank {i % n}" if n > 1 else ""), i // n)
        workers = [w for groups in self.ranks.values() for ranks in groups for w in ranks]
        start = dict(timeout_s=self.deadlines.start_s, key="cluster.start_timeout_s")
        ROSTER.locate(workers, ray_get([w.where.remote() for w in workers], "starting the teachers", **start))
        groups = [ranks for g in self.ranks.values() for ranks in g if len(ranks) > 1]
        masters = ray_get([ranks[0].address.remote() for ranks in groups], "starting the teachers", **start)
        ray_get([w.join.remote(m) for ranks, m in zip(groups, masters) for w in ranks], "starting the teachers", **start)
        infos = ray_get([w.info.remote() for w in workers], "starting the teachers", **start)
        self.info = {i["alias"]: i for i in infos if i["rank"] == 0}

    def score(self, rows_by_alias: dict[str, Sequence]) -> tuple[dict[str, list], int]:
        """(logprobs per alias, one `[len]` tensor per real row in row order; the teacher batches scored: one
        per replica given rows)."""
        from gymv.cluster.group import ray_get

        pending = {}
        for alias, rows in rows_by_alias.items():
            if not rows:
                continue
            if alias not in self.replicas:
                raise GymvError(f"no teacher {alias!r}", where="mopd.teachers", fix=f"use one of: {', '.join(self.replicas)}")
            padded, n = pad_rows(rows, self.dp[alias])
            shards = shard_rows(padded, self.dp[alias])
            # every rank of a replica scores its shard (their forward passes meet in collectives)
            pending[alias] = (n, [[w.score.remote(s) for w in ranks] for ranks, s in zip(self.ranks[alias], shards)])
        out = {}
        for alias, (n, refs) in pending.items():
            parts = ray_get([r for ranks in refs for r in ranks], f"teacher {alias!r} scoring", self.deadlines.phase_s)
            firsts = parts[::len(refs[0])]  # each replica's first rank
            out[alias] = trim([lp for p in firsts for lp in p["logprobs"]], n)
        return out, sum(len(refs) for _, refs in pending.values())

    def shutdown(self) -> None:
        import ray

        for groups in self.ranks.values():
            for w in (w for ranks in groups for w in ranks):
                try:
                    ray.kill(w)
                except Exception:
                    pass
                ROSTER.drop(w)
        self.replicas, self.ranks = {}, {}
        if self._pgs:
            from ray.util.placement_group import remove_placement_group

            for pg in self._pgs:
                remove_placement_group(pg)
            self._pgs = []
