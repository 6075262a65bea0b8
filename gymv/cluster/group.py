"""Driver side of the workers: place the actors (`cluster.*`), fan each phase out in one Ray round trip,
and turn a worker's failure into one clear error.

Placement (gymv.cluster.roles plans it, gymv.cluster.ray_placement asks Ray for it):
- CPU (`gpus_per_node: 0`): one generation worker and one training worker (or `num_training` ranks),
  reserving no CPUs, since the phases of a synchronous step alternate and each takes every thread; with
  `nodes` > 1 the ranks sit in a SPREAD placement group of one CPU bundle each (one rank per node where
  there are as many nodes). Their OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless set):
  spinning threads of an idle actor, or of any other process on a busy machine, made steps 5-10x slower
  on 2 cores.
- GPUs, colocated: one bundle per GPU; training rank i and generation worker i share bundle i
  (`self.placement_group`, which other actors such as MOPD teachers may join).
- GPUs, separate: a placement group per role, a bundle per engine (its tensor-parallel GPUs) and per
  tensor-parallel group of training ranks, so neither spans nodes.
- `generation_workers_per_gpu` k > 1: k generation workers share each generation GPU (on a CPU: k in all);
  a batch is split by prompt across all of them.
- `cluster.placement.<role>` sets a role's strategy and pins it to nodes by label or custom resource.
Every wait on Ray has a deadline (`cluster.*_timeout_s`); a lost worker is named with its node.
The arithmetic of engines spanning several GPUs and of trainer meshes is gymv.cluster.placement.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gymv.cluster.placement import Placement
from gymv.cluster.ray_cluster import cpu_actor_options
from gymv.cluster.ray_placement import ROSTER, actor_options, deferred_start, lost_worker_error, place
from gymv.backends.registry import GENERATION_BACKENDS
from gymv.cluster.refit import shares_sending
from gymv.cluster.refit_check import CheckRequest, plan_checks
from gymv.cluster.roles import policy_plans
from gymv.cluster.transport_choice import Layout, choose_transport
from gymv.cluster.workers import SEQ_ERRORS_KEY, GenerationWorker, RolloutRequest, TrainingWorker, WorkerSpec
from gymv.errors import GymvError, WriteError
from gymv.io import is_write_failure, write_error
from gymv.timing import phase_key


def ray_get(refs, phase: str, timeout_s: float | None = None, *, key: str = "cluster.phase_timeout_s"):
    """ray.get that re-raises a worker's GymvError as itself and anything else as one GymvError line; a
    lost worker is named with its role, rank and node (gymv.cluster.ray_placement); past `timeout_s` the
    wait stops with the phase and the key that sets its deadline."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise GymvError(f"{phase} did not finish within {timeout_s:g} s", where=phase, exit_code=1,
                        fix=f"see the workers' logs for a hang; a slower phase needs a larger {key}") from None
    except RayTaskError as e:
        if os.environ.get("GYMV_DEBUG"):
            print(str(e), file=sys.stderr)  # the worker's own traceback
        cause = getattr(e, "cause", None)
        if isinstance(cause, GymvError):
            raise type(cause)(cause.message, where=cause.where, fix=cause.fix, exit_code=cause.exit_code) from None
        if is_write_failure(cause):  # a full or read-only disk, not a training problem
            err = write_error(cause.filename or phase, cause)
            raise WriteError(f"{phase} failed in a worker: {err.message}", where=err.where, fix=err.fix,
                             exit_code=1) from None
        if isinstance(cause, RayActorError):  # an actor this task waited on died
            raise lost_worker_error(cause, phase) from None
        text = str(cause) if cause is not None else str(e)
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        hint = ("; non-finite weights usually mean the learning rate is too high"
                if re.search(r"\b(nan|inf|infinity|non-finite|not finite)\b", lines[-1] if lines else "", re.I) else "")
        raise GymvError(f"{phase} failed in a worker: {type(cause).__name__ if cause else 'error'}: "
                        f"{lines[-1] if lines else ''}", where=phase, exit_code=1,
                        fix="run with --debug for the worker traceback" + hint) from None
    except RayActorError as e:
        if os.environ.get("GYMV_DEBUG"):
            print(str(e), file=sys.stderr)
        raise lost_worker_error(e, phase) from None


REFIT_GROUP = "refit"


def rollout_memory(stats: Sequence[dict]) -> dict[str, float]:
    """The generation workers' `memory/` figures (gymv.cluster.device_memory), the largest of any worker."""
    names = {k for st in stats for k in st if k.startswith("memory/")}
    return {n: max(st.get(n, 0.0) for st in stats) for n in sorted(names)}


def rollout_timing(stats: Sequence[dict]) -> dict[str, float]:
    """The slowest generation worker's environment seconds and split of generation (gymv.rollout.loop.BREAKDOWN)
    as `timing/` keys for PhaseTimer.take: `env_s` is timing/env_s, `breakdown/render_s` timing/generation/render_s."""
    names = {"env_s", *(k for st in stats for k in st if k.startswith("breakdown/"))}
    return {phase_key(n.replace("breakdown/", "generation/").removesuffix("_s")): max(st.get(n, 0.0) for st in stats)
            for n in names}


@dataclass
class RolloutCall:
    """One generation worker's share of a batch of rollouts, in flight (`ref`) or to (re)submit."""

    worker: int
    rows: list
    request: RolloutRequest  # this worker's share: its own seed
    ref: object = None
    submitted_at: float = 0.0
    attempts: int = 0


def _split(items: Sequence, parts: int) -> list[list]:
    size = math.ceil(len(items) / parts) if items else 0
    return [list(items[i * size:(i + 1) * size]) for i in range(parts)]


def shard_minibatches(minibatches: list[list], world: int) -> list[list[list]]:
    """Each rank's contiguous part of every minibatch: shards[r][i] is rank r's part of minibatch i."""
    per_rank: list[list[list]] = [[] for _ in range(world)]
    for mb in minibatches:
        for r, part in enumerate(_split(mb, world)):
            per_rank[r].append(part)
    return per_rank


def unshard(shards: list[list[list]], per_rank: list[list]) -> list:
    """One value per sample in the order of the minibatches that `shard_minibatches` split into `shards`
    (rank r's part of minibatch i is shards[r][i]), from each rank's values in its own sample order."""
    values = [iter(v) for v in per_rank]
    num_minibatches = len(shards[0]) if shards else 0
    return [next(values[r]) for i in range(num_minibatches) for r, shard in enumerate(shards) for _ in shard[i]]


class PolicyCluster:
    """The generation workers and training ranks of one run, driven phase by phase."""

    def __init__(self, spec: WorkerSpec, placement: Placement, *, generation: bool = True, gpu_share: float = 0.5,
                 in_flight_refit: bool = False, lagging_receivers: bool = False):
        """`lagging_receivers`: generators may read a refit after the next one is published (async GRPO),
        which `refit.transport: auto` must allow for."""
        import ray

        spec = spec.located()  # backends registered in this process load in the workers too
        self.spec, self.placement, self.deadlines = spec, placement, placement.deadlines
        self.plans = policy_plans(placement, generation=generation, gpu_share=gpu_share)
        self._pgs: dict[str, object] = {}
        opts: dict[str, list[dict]] = {"training": [], "generation": []}
        base = {} if placement.gpus else cpu_actor_options()
        try:
            for plan in self.plans:
                pg = place(plan, self.deadlines.placement_s)
                if pg is not None:
                    self._pgs[plan.role] = pg
                for kind, slots in plan.workers.items():
                    opts[kind] = [actor_options(plan, s, pg, base) for s in slots]
            self._check_tensor_groups()
        except BaseException:
            self._remove_groups()
            raise
        Train = ray.remote(deferred_start(TrainingWorker))  # a worker that cannot start says why in one line
        # in-flight refits run in their own concurrency group, beside a rollout in progress
        self._Gen = ray.remote(deferred_start(GenerationWorker))
        if in_flight_refit:
            self._Gen = ray.remote(concurrency_groups={REFIT_GROUP: 1})(deferred_start(GenerationWorker))
        self.in_flight_refit = in_flight_refit
        self._gen_opts = opts["generation"]
        world = placement.num_training
        self.trainers = [Train.options(**o).remote(spec, r, world) for r, o in enumerate(opts["training"])]
        self.generators = [self._Gen.options(**o).remote(spec, i) for i, o in enumerate(opts["generation"])]
        for r, a in enumerate(self.trainers):
            ROSTER.add(a, "training", r)
        for i, a in enumerate(self.generators):
            ROSTER.add(a, "generation", i)
        self._refit_ready = False
        self.checks = plan_checks(spec.refit.check, GENERATION_BACKENDS.capabilities(spec.generation.backend).refit_check,
                                  spec.generation_dtype)
        self.refits = 0  # refits sent by this process (the numbering of refit checks)
        self._verifies: dict[int, list] = {}  # version -> its refit's check refs, until waited for
        self._probe = None
        try:
            self._start(lagging_receivers)
        except BaseException:  # nothing of a cluster that failed to start outlives it
            self.shutdown()
            raise

    def _start(self, lagging_receivers: bool) -> None:
        """Every worker starts at once: the training ranks build their backends (once rank 0's rendezvous is
        known) while the generation workers are still loading their engines, so the two model loads overlap
        instead of one waiting for the other. A worker's failed constructor surfaces from its `where`."""
        start = dict(timeout_s=self.deadlines.start_s, key="cluster.start_timeout_s")
        everyone = self.trainers + self.generators
        located = [a.where.remote() for a in everyone]
        world = len(self.trainers)
        master = None
        if world > 1:
            ROSTER.locate(self.trainers, ray_get(located[:world], "starting the workers", **start))
            master = ray_get(self.trainers[0].address.remote(), "starting the training workers", **start)
        refs = [t.setup.remote(master) for t in self.trainers]
        refs += [g.stats.remote() for g in self.generators]  # waits for the generation workers to load
        ROSTER.locate(everyone, ray_get(located, "starting the workers", **start))
        self.info = ray_get(refs, "starting the workers", **start)[0]
        self.transport = self._choose_transport(lagging_receivers)
        self.check_weights()

    def _check_tensor_groups(self) -> None:
        """Colocated, a tensor-parallel group of training ranks spans bundles of one GPU each: they must
        have landed on one node (separate GPUs give each group one bundle, which cannot be split)."""
        pg, tp = self._pgs.get("policy"), self.placement.trainer_mesh.tensor
        if pg is None or tp == 1:
            return
        from ray.util import placement_group_table

        on = placement_group_table(pg)["bundles_to_node_id"]
        for first in range(0, self.placement.num_training, tp):
            nodes = {on[r % self.placement.gpus] for r in range(first, first + tp)}
            if len(nodes) > 1:
                raise GymvError(f"training ranks {first}-{first + tp - 1} (one tensor-parallel group) landed on "
                                f"{len(nodes)} nodes", where="cluster.placement.training", exit_code=1,
                                fix="use strategy STRICT_PACK per node, or cluster.colocated: false (one bundle per group)")

    def _remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs.values():
            remove_placement_group(pg)
        self._pgs = {}

    @property
    def placement_group(self):
        """The policy's placement group on GPUs when colocated (one bundle per GPU), else None."""
        return self._pgs.get("policy")

    def where(self) -> dict[str, list[dict]]:
        """Where each worker runs: role -> [{rank, node_id, address, gpus}] (the run's placement.json)."""
        out: dict[str, list[dict]] = {}
        for a in self.trainers + self.generators:
            seat = ROSTER.seats.get(a._actor_id.hex())
            if seat is not None:
                out.setdefault(seat.role, []).append({"rank": seat.rank, "node_id": seat.node_id,
                                                      "address": seat.address, "gpus": seat.gpus})
        return out

    def _get(self, refs, phase: str):
        return ray_get(refs, phase, self.deadlines.phase_s)

    # -- generation ----------------------------------------------------------------------------------
    def submit_rollouts(self, rows: Sequence[tuple[int, dict]], request: RolloutRequest) -> list[RolloutCall]:
        """Start rollouts of every row, split by prompt across generation workers; returns at once."""
        if not self.generators:
            raise GymvError("this run has no generation worker", where="cluster",
                            fix="give the recipe generation workers (cluster.*), or train with SFT, which needs none")
        calls = []
        for i, chunk in enumerate(_split(list(rows), len(self.generators))):
            if chunk:
                calls.append(self.resubmit(RolloutCall(i, chunk, request.split(i))))
        return calls

    def resubmit(self, call: RolloutCall) -> RolloutCall:
        """(Re)start one rollout call on its generation worker."""
        call.attempts += 1
        call.ref = self.generators[call.worker].rollouts.remote(call.rows, call.request)
        call.submitted_at = time.time()
        return call

    def rollouts(self, rows: Sequence[tuple[int, dict]], request: RolloutRequest) -> tuple[list, dict]:
        """Rollouts of every row, split by prompt across generation workers, in row order; also the seconds the
        workers measured (`timing/` keys for the step's PhaseTimer.take) and, on GPUs, their memory (`memory/`)."""
        calls = self.submit_rollouts(rows, request)
        out = self._get([c.ref for c in calls], "generation")
        stats = [o["stats"] for o in out]
        return [t for o in out for t in o["trajectories"]], {**rollout_timing(stats), **rollout_memory(stats)}

    # -- training ------------------------------------------------------------------------------------
    def _shard(self, minibatches: list[list]) -> list[list[list]]:
        return shard_minibatches(minibatches, len(self.trainers))

    def grpo_step(self, minibatches: list[list[dict]], loss_fn, seq_error_threshold: float | None = None) -> dict:
        """One algorithm step's updates. With `seq_error_threshold`, the metrics carry every sample's
        sequence-level logprob error under SEQ_ERRORS_KEY, in the order of `minibatches`."""
        shards = self._shard(minibatches)
        out = self._get([t.grpo_step.remote(s, loss_fn, seq_error_threshold) for t, s in zip(self.trainers, shards)],
                      "training")
        metrics = out[0]
        if seq_error_threshold is not None:  # each rank scored its own shard of every minibatch
            metrics[SEQ_ERRORS_KEY] = unshard(shards, [o[SEQ_ERRORS_KEY] for o in out])
        return metrics

    def sft_step(self, rows: list[tuple[int, dict, str]], loss_fn,
                 upcoming: list[tuple[int, dict, str]] | None = None) -> dict:
        """One SFT step; `upcoming` (the next step's rows) lets each rank lay out its next shard meanwhile."""
        shards = self._shard([rows])
        nxt = self._shard([upcoming]) if upcoming else [[None]] * len(self.trainers)
        return self._get([t.sft_step.remote(s[0], loss_fn, u[0]) for t, s, u in zip(self.trainers, shards, nxt)],
                         "training")[0]

    # -- refit ---------------------------------------------------------------------------------------
    def _followers(self) -> list:
        """Ranks other than 0 joining rank 0's read of the weights (a sharded trainer gathers them)."""
        return [t.follow_weights.remote() for t in self.trainers[1:]]

    def _choose_transport(self, lagging: bool) -> str:
        """`refit.transport` checked against (or, for auto, chosen from) where the workers landed."""
        seats = [ROSTER.seats[a._actor_id.hex()] for a in self.trainers + self.generators]
        p = self.placement
        layout = Layout(gpus=p.gpus > 0, colocated=p.colocated, workers_per_gpu=p.generation_per_gpu, lag_safe=lagging)
        chosen = choose_transport(self.spec.refit.transport, seats[:1], seats[len(self.trainers):], layout)
        self._senders = self.trainers if len(self.trainers) > 1 and shares_sending(chosen) else self.trainers[:1]
        return chosen

    def _publish(self, check: CheckRequest | None = None) -> tuple[list, list]:
        """(each sending rank's publish ref, the other ranks' follow refs): with a transport that shares
        sending, every rank ships its share of the buckets, so no rank carries the whole model's traffic."""
        return ([t.publish.remote(check) for t in self._senders],
                [t.follow_weights.remote(check) for t in self.trainers[len(self._senders):]])

    def _connect_refit(self) -> None:
        n, senders = len(self.generators), len(self._senders)
        opened = self._get([t.refit_open.remote(n, self.transport, senders) for t in self._senders]
                           + [t.follow_weights.remote() for t in self.trainers[senders:]], "refit setup")[:senders]
        self._in_band = opened[0]["in_band"]
        info = opened[0]["info"] if senders == 1 else [o["info"] for o in opened]  # a group per sending rank
        refs = [t.refit_connect.remote() for t in self._senders]
        refs += [g.refit_connect.remote(info, 1 + i, self.transport) for i, g in enumerate(self.generators)]
        self._get(refs, "refit setup")  # collective transports rendezvous here, all sides at once
        self._refit_ready = True

    def _receive_calls(self, version: int, parts: list, check: CheckRequest | None, *, in_flight: bool = False) -> list:
        """Each generator's receive of the published `parts`, and with `check` its verification right behind it
        (in the same concurrency group, so nothing loads in between), against rank 0's side of the check."""
        # in-band: each receiver waits for the published objects; otherwise they meet inside the broadcast
        handed = parts if self._in_band else [None]
        trainer = self.trainers[0].refit_check.remote() if check is not None else None
        out = []
        for g in self.generators:
            receive = g.receive.options(concurrency_group=REFIT_GROUP) if in_flight else g.receive
            out.append(receive.remote(handed[0], version, *handed[1:]))
            if check is not None:
                verify = g.verify_weights.options(concurrency_group=REFIT_GROUP) if in_flight else g.verify_weights
                out.append(verify.remote(check, trainer))
                self._verifies.setdefault(version, []).append(out[-1])
        return out

    def wait_checked(self, versions) -> None:
        """Wait for the checks of the refits that carried these versions (asynchronous runs call it before
        training on rollouts of those weights); a failed check is raised here."""
        import ray
        from ray.exceptions import RayActorError

        refs = [r for v in sorted(set(versions)) for r in self._verifies.pop(v, [])]
        if not refs:
            return
        ray.wait(refs, num_returns=len(refs), timeout=self.deadlines.phase_s)
        for ref in refs:
            try:
                ray.get(ref, timeout=0)
            except RayActorError:  # a generation worker that died is replaced; its check went with it
                continue
            except Exception:
                self._get(ref, "refit check")  # raised again as one line (a failed check, a deadline)

    def _check_request(self, refit: int, version: int = 0) -> CheckRequest | None:
        """The check of refit number `refit` (carrying step `version`'s weights) when `refit.check` has it due."""
        plan = self.checks
        if not plan.due(refit):
            return None
        if plan.kind == "probe" and self._probe is None:
            self._probe = self._get(self.trainers[0].refit_probe.remote(plan.probe_tokens), "refit check setup")
        return CheckRequest(plan.kind, refit, self.transport, self._probe if plan.kind == "probe" else None,
                            plan.tolerance, version)

    def check_weights(self) -> None:
        """Check that every engine holds the trainer's weights now (refit 0 of `refit.check`: at start, the
        checkpoint each side loaded); a mismatch is the error of the phase."""
        check = self._check_request(0) if self.generators else None
        if check is None:
            return
        sides = [t.weights_check.remote(check) for t in self.trainers]
        verify = [g.verify_weights.remote(check, sides[0]) for g in self.generators]
        self._get(sides + verify, "checking the engines' weights")

    def refit(self, version: int) -> float:
        """Send the trainer's weights to every generation worker (checked when `refit.check` has it due);
        seconds, as the driver saw them."""
        if not self.generators:
            return 0.0
        t0 = time.perf_counter()
        self._get(self._send_refit(version, in_flight=False), "refit")
        self._verifies.pop(version, None)
        return time.perf_counter() - t0

    def refit_async(self, version: int) -> list:
        """Queue the trainer's new weights to every generation worker without waiting: each loads them after
        the rollout it is running (or, with in-flight refits, between two of its generate calls), and checks
        them right after when due. The refs resolve to each receiver's result; a worker's error (a failed
        check included) surfaces when they are read."""
        if not self.generators:
            return []
        return self._send_refit(version, in_flight=self.in_flight_refit)

    def _send_refit(self, version: int, *, in_flight: bool) -> list:
        if not self._refit_ready:
            self._connect_refit()
        self.refits += 1
        check = self._check_request(self.refits, version)
        parts, followers = self._publish(check)
        return parts + self._receive_calls(version, parts, check, in_flight=in_flight) + followers

    def replace_generator(self, index: int, version: int) -> None:
        """Start a new generation worker in place of a dead one, with the trainer's current weights."""
        import ray

        if self._refit_ready and not self._in_band:
            raise GymvError(f"generation worker {index} died, and refit transport {self.transport!r} "
                            "cannot take a new member into its group", where="refit.transport",
                            fix="use refit.transport: object_store to survive generation worker failures", exit_code=1)
        try:
            ray.kill(self.generators[index])
        except Exception:
            pass
        ROSTER.drop(self.generators[index])
        fresh = self._Gen.options(**self._gen_opts[index]).remote(self.spec, index)
        ROSTER.add(fresh, "generation", index)
        weights = self.trainers[0].weights.remote()
        refs = [fresh.where.remote(), fresh.restore.remote(weights, version)]
        if self._refit_ready:  # an in-band transport: the newcomer reads the next refit like the others
            refs.append(fresh.refit_connect.remote(None, 1 + index, self.transport))
        got = ray_get(refs + self._followers(), "restarting a generation worker", self.deadlines.start_s,
                      key="cluster.start_timeout_s")
        ROSTER.locate([fresh], got[:1])
        self.generators[index] = fresh

    def weight_hashes(self) -> tuple[str, list[str]]:
        """(trainer hash in the generation dtype, each generation worker's hash): equal after a refit."""
        refs = [self.trainers[0].weights_hash.remote()] + [g.weights_hash.remote() for g in self.generators]
        got = self._get(refs + self._followers(), "weight hashes")
        return got[0], got[1:len(refs)]

    def generation_stats(self) -> list[dict]:
        return self._get([g.stats.remote() for g in self.generators], "generation stats")

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_bytes(self) -> int | None:
        """About the bytes of one checkpoint, every rank's share; None where a backend cannot tell."""
        shares = self._get([t.checkpoint_bytes.remote() for t in self.trainers], "sizing a checkpoint")
        return None if any(s is None for s in shares) else sum(shares)

    def save(self, path) -> None:
        self._get([t.save.remote(str(path)) for t in self.trainers], "saving a checkpoint")

    def load(self, path) -> int:
        return self._get([t.load.remote(str(path)) for t in self.trainers], "loading a checkpoint")[0]

    def export(self, path) -> str:
        return self._get([t.export.remote(str(path)) for t in self.trainers], "exporting the final model")[0]

    def shutdown(self) -> list[str]:
        """Close and kill every worker, then keep no handle or ref of them (the refit's sending ranks, its
        pending checks, its probe): they are released here, on the caller's thread. A cluster still reachable
        afterwards, as a failed run's traceback keeps it, in a reference cycle, would otherwise hand their
        release to the cyclic collector, in whichever thread next allocates (often Ray's log printer, woken by
        the killed workers' last lines). Every worker is asked to close at once, since a training rank's close
        waits at a barrier for its peers' (gymv.backends.training.process_group). Returns the workers that did
        not close cleanly within 30 s (killed all the same), as "training rank R" / "generation worker I"."""
        import ray

        named = [(a, f"training rank {r}") for r, a in enumerate(self.trainers)]
        named += [(a, f"generation worker {i}") for i, a in enumerate(self.generators)]
        closing = {}
        for a, name in named:
            try:
                closing[a.close.remote()] = name
            except Exception:
                pass
        done, _ = ray.wait(list(closing), num_returns=len(closing), timeout=30) if closing else ([], [])
        closed = set()
        for ref in done:
            try:
                if ray.get(ref) is not False:
                    closed.add(closing[ref])
            except Exception:
                pass
        for a, _ in named:
            ray.kill(a)
            ROSTER.drop(a)
        self.trainers, self.generators, self._senders = [], [], []
        self._verifies.clear()
        self._probe = None
        self._remove_groups()
        return [name for _, name in named if name not in closed]


class TrainerHandle:
    """What CheckpointManager needs (save/load into a folder), backed by the training workers."""

    def __init__(self, cluster: PolicyCluster):
        self.cluster = cluster

    def checkpoint_bytes(self) -> int | None:
        return self.cluster.checkpoint_bytes()

    def save(self, path) -> None:
        self.cluster.save(path)

    def load(self, path) -> None:
        self.cluster.load(path)
