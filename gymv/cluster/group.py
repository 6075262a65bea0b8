"""Driver side of the workers: place the actors (`cluster.*`), fan each phase out in one Ray round trip,
and turn a worker's failure into one clear error.

Placement:
- CPU (`gpus_per_node: 0`): one generation worker and one training worker (or `num_training` ranks),
  reserving no CPUs, since the phases of a synchronous step alternate and each takes every thread; with
  `nodes` > 1 the ranks sit in a SPREAD placement group of one CPU bundle each (one rank per node where
  there are as many nodes). Their
  OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless set): spinning threads of an idle actor,
  or of any other process on a busy machine, made steps 5-10x slower on 2 cores.
- GPUs, colocated: one bundle per GPU; training rank i and generation worker i share bundle i
  (`self.placement_group`, which other actors such as MOPD teachers may join).
- GPUs, separate: `training_gpus` training ranks and `generation_gpus` generation workers, one GPU each.
- `generation_workers_per_gpu` k > 1: k generation workers share each generation GPU (on a CPU: k in all);
  a batch is split by prompt across all of them.
The arithmetic of engines spanning several GPUs and of trainer meshes is gymv.cluster.placement.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gymv.cluster.placement import Placement
from gymv.cluster.workers import SEQ_ERRORS_KEY, GenerationWorker, TrainingWorker, WorkerSpec
from gymv.errors import GymvError, WriteError
from gymv.io import is_write_failure, write_error


def ray_get(refs, phase: str):
    """ray.get that re-raises a worker's GymvError as itself and anything else as one GymvError line."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(refs)
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
        text = str(cause) if cause is not None else str(e)
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        raise GymvError(f"{phase} failed in a worker: {type(cause).__name__ if cause else 'error'}: "
                        f"{lines[-1] if lines else ''}", where=phase, exit_code=1,
                        fix="run with --debug for the worker traceback; non-finite weights usually mean the learning rate is too high") from None
    except RayActorError as e:
        raise GymvError(f"a worker died during {phase}: {str(e).splitlines()[0]}", where=phase, exit_code=1,
                        fix="the process may have run out of memory; lower the batch sizes or micro_batch_tokens") from None


REFIT_GROUP = "refit"


@dataclass
class RolloutCall:
    """One generation worker's share of a batch of rollouts, in flight (`ref`) or to (re)submit."""

    worker: int
    rows: list
    seed: int
    kwargs: dict
    ref: object = None
    submitted_at: float = 0.0
    attempts: int = 0


def cpu_env() -> dict[str, str]:
    """Environment of CPU actors: passive OpenMP waiting (the user's own setting wins)."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


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
                 in_flight_refit: bool = False):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = spec.located()  # backends registered in this process load in the workers too
        self.spec, self.placement = spec, placement
        self._pg = None
        gen_opts: list[dict] = []
        train_opts: list[dict] = []
        n_gen = placement.num_generation if generation else 0
        if placement.gpus == 0:
            cpu = {"num_cpus": 0, "runtime_env": {"env_vars": cpu_env()}}
            gen_opts = [cpu] * n_gen
            train_opts = [cpu] * placement.num_training
            if placement.nodes > 1 and placement.num_training > 1:  # one CPU bundle per rank, spread over nodes
                self._pg = placement_group([{"CPU": 1}] * placement.num_training, strategy="SPREAD")
                ray_get(self._pg.ready(), "placing the training ranks")
                train_opts = [{**cpu, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i)} for i in range(placement.num_training)]
        elif placement.colocated:
            self._pg = placement_group([{"GPU": 1, "CPU": 1}] * placement.gpus, strategy="PACK")
            ray_get(self._pg.ready(), "placing workers on GPUs")
            at = lambda i, share=gpu_share: {  # noqa: E731  (less than 0.5 leaves room for a colocated MOPD teacher)
                "num_cpus": 0, "num_gpus": share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)}
            gen_opts = [at(i % placement.gpus, gpu_share / placement.generation_per_gpu) for i in range(n_gen)]
            train_opts = [at(i % placement.gpus) for i in range(placement.num_training)]
        else:
            gen_opts = [{"num_cpus": 0, "num_gpus": 1 / placement.generation_per_gpu}] * n_gen
            train_opts = [{"num_cpus": 0, "num_gpus": 1}] * placement.num_training
        Train = ray.remote(TrainingWorker)
        # in-flight refits run in their own concurrency group, beside a rollout in progress
        self._Gen = ray.remote(GenerationWorker)
        if in_flight_refit:
            self._Gen = ray.remote(concurrency_groups={REFIT_GROUP: 1})(GenerationWorker)
        self.in_flight_refit = in_flight_refit
        self._gen_opts = gen_opts
        world = placement.num_training
        self.trainers = [Train.options(**o).remote(spec, r, world) for r, o in enumerate(train_opts)]
        self.generators = [self._Gen.options(**o).remote(spec, i) for i, o in enumerate(gen_opts)]
        master = ray_get(self.trainers[0].address.remote(), "starting the training workers") if world > 1 else None
        refs = [t.setup.remote(master) for t in self.trainers]
        refs += [g.stats.remote() for g in self.generators]  # waits for the generation workers to load
        self.info = ray_get(refs, "starting the workers")[0]
        self._refit_ready = False

    @property
    def placement_group(self):
        """The policy's placement group on GPUs when colocated (one bundle per GPU), else None."""
        return self._pg if self.placement.gpus else None

    # -- generation ----------------------------------------------------------------------------------
    def submit_rollouts(self, rows: Sequence[tuple[int, dict]], *, seed: int, **kwargs) -> list[RolloutCall]:
        """Start rollouts of every row, split by prompt across generation workers; returns at once."""
        if not self.generators:
            raise GymvError("this run has no generation worker", where="cluster")
        calls = []
        for i, chunk in enumerate(_split(list(rows), len(self.generators))):
            if chunk:
                call = RolloutCall(i, chunk, seed + 104729 * i, kwargs)
                calls.append(self.resubmit(call))
        return calls

    def resubmit(self, call: RolloutCall) -> RolloutCall:
        """(Re)start one rollout call on its generation worker."""
        call.attempts += 1
        call.ref = self.generators[call.worker].rollouts.remote(call.rows, seed=call.seed, **call.kwargs)
        call.submitted_at = time.time()
        return call

    def rollouts(self, rows: Sequence[tuple[int, dict]], *, seed: int, **kwargs) -> tuple[list, dict]:
        """Rollouts of every row, split by prompt across generation workers, in row order; also timings."""
        t0 = time.perf_counter()
        calls = self.submit_rollouts(rows, seed=seed, **kwargs)
        out = ray_get([c.ref for c in calls], "generation")
        timing = {"generation_s": time.perf_counter() - t0,
                  "env_s": max(o["stats"].get("env_s", 0.0) for o in out)}
        for key in {k for o in out for k in o["stats"] if k.startswith("breakdown/")}:  # the slowest worker's
            timing[key] = max(o["stats"].get(key, 0.0) for o in out)
        return [t for o in out for t in o["trajectories"]], timing

    # -- training ------------------------------------------------------------------------------------
    def _shard(self, minibatches: list[list]) -> list[list[list]]:
        return shard_minibatches(minibatches, len(self.trainers))

    def grpo_step(self, minibatches: list[list[dict]], loss_fn, seq_error_threshold: float | None = None) -> dict:
        """One algorithm step's updates. With `seq_error_threshold`, the metrics carry every sample's
        sequence-level logprob error under SEQ_ERRORS_KEY, in the order of `minibatches`."""
        shards = self._shard(minibatches)
        out = ray_get([t.grpo_step.remote(s, loss_fn, seq_error_threshold) for t, s in zip(self.trainers, shards)],
                      "training")
        metrics = out[0]
        if seq_error_threshold is not None:  # each rank scored its own shard of every minibatch
            metrics[SEQ_ERRORS_KEY] = unshard(shards, [o[SEQ_ERRORS_KEY] for o in out])
        return metrics

    def sft_step(self, rows: list[tuple[int, dict, str]], loss_fn) -> dict:
        shards = self._shard([rows])
        return ray_get([t.sft_step.remote(s[0], loss_fn) for t, s in zip(self.trainers, shards)], "training")[0]

    # -- refit ---------------------------------------------------------------------------------------
    def _followers(self) -> list:
        """Ranks other than 0 joining rank 0's read of the weights (a sharded trainer gathers them)."""
        return [t.follow_weights.remote() for t in self.trainers[1:]]

    def _connect_refit(self) -> None:
        opened = ray_get([self.trainers[0].refit_open.remote(len(self.generators))] + self._followers(),
                         "refit setup")[0]
        self._in_band = opened["in_band"]
        refs = [self.trainers[0].refit_connect.remote()]
        refs += [g.refit_connect.remote(opened["info"], 1 + i) for i, g in enumerate(self.generators)]
        ray_get(refs, "refit setup")  # collective transports rendezvous here, all sides at once
        self._refit_ready = True

    def refit(self, version: int) -> float:
        """Send the trainer's weights to every generation worker; seconds, as the driver saw them."""
        if not self.generators:
            return 0.0
        t0 = time.perf_counter()
        if not self._refit_ready:
            self._connect_refit()
        payload = self.trainers[0].publish.remote()
        followers = self._followers()
        # in-band: each receiver waits for the published object; otherwise they meet inside the broadcast
        handed = payload if self._in_band else None
        ray_get([payload] + [g.receive.remote(handed, version) for g in self.generators] + followers, "refit")
        return time.perf_counter() - t0

    def refit_async(self, version: int) -> list:
        """Queue the trainer's new weights to every generation worker without waiting: each loads them after
        the rollout it is running (or, with in-flight refits, between two of its generate calls). The refs
        resolve to each receiver's result; a worker's error surfaces when they are read."""
        if not self.generators:
            return []
        if not self._refit_ready:
            self._connect_refit()
        payload = self.trainers[0].publish.remote()
        followers = self._followers()
        handed = payload if self._in_band else None
        receive = [g.receive.options(concurrency_group=REFIT_GROUP) if self.in_flight_refit else g.receive
                   for g in self.generators]
        return [payload] + [r.remote(handed, version) for r in receive] + followers

    def replace_generator(self, index: int, version: int) -> None:
        """Start a new generation worker in place of a dead one, with the trainer's current weights."""
        import ray

        if self._refit_ready and not self._in_band:
            raise GymvError(f"generation worker {index} died, and refit transport {self.spec.refit_transport!r} "
                            "cannot take a new member into its group", where="refit.transport",
                            fix="use refit.transport: object_store to survive generation worker failures", exit_code=1)
        try:
            ray.kill(self.generators[index])
        except Exception:
            pass
        fresh = self._Gen.options(**self._gen_opts[index]).remote(self.spec, index)
        weights = self.trainers[0].weights.remote()
        ray_get([fresh.restore.remote(weights, version)] + self._followers(), "restarting a generation worker")
        self.generators[index] = fresh

    def weight_hashes(self) -> tuple[str, list[str]]:
        """(trainer hash in the generation dtype, each generation worker's hash): equal after a refit."""
        refs = [self.trainers[0].weights_hash.remote()] + [g.weights_hash.remote() for g in self.generators]
        got = ray_get(refs + self._followers(), "weight hashes")
        return got[0], got[1:len(refs)]

    def generation_stats(self) -> list[dict]:
        return ray_get([g.stats.remote() for g in self.generators], "generation stats")

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, path) -> None:
        ray_get([t.save.remote(str(path)) for t in self.trainers], "saving a checkpoint")

    def load(self, path) -> int:
        return ray_get([t.load.remote(str(path)) for t in self.trainers], "loading a checkpoint")[0]

    def export(self, path) -> str:
        return ray_get([t.export.remote(str(path)) for t in self.trainers], "exporting the final model")[0]

    def shutdown(self) -> None:
        import ray

        for a in self.trainers + self.generators:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
        self.trainers, self.generators = [], []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None


class TrainerHandle:
    """What CheckpointManager needs (save/load into a folder), backed by the training workers."""

    def __init__(self, cluster: PolicyCluster):
        self.cluster = cluster

    def save(self, path) -> None:
        self.cluster.save(path)

    def load(self, path) -> None:
        self.cluster.load(path)
