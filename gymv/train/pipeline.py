"""Generation running ahead of training (async GRPO's producer side), driven from the training loop.

Batch j holds the prompts that training step j will train on (drawn in the synchronous loop's data order,
sampled with the same per-step seed). It is submitted as soon as the newest weights queued to the
generators are recent enough for step j: version >= j - 1 - max_age. Refits and rollouts queue on each
generation worker in submission order, so batch j is generated with exactly that version, whatever the
timing: an async run is as reproducible as a synchronous one, and with max_age 0 it is the synchronous run.

Faults: a generation worker that dies is replaced (a new actor with the trainer's current weights) and its
unfinished calls are resubmitted, up to `max_attempts` each; after that their prompts are dropped and the
step is filled with a replacement batch drawn with the newest weights. Groups too old for the step that
would take them are dropped and counted (the replay buffer's bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gymv.cluster.group import RolloutCall, ray_get
from gymv.cluster.workers import RolloutRequest
from gymv.errors import GymvError
from gymv.runs.checkpoint import DataPosition
from gymv.timing import phase_key
from gymv.train.data import RowStream
from gymv.train.replay import Group, ReplayBuffer
from gymv.train.setup import step_seed


_DIED = object()


def _result(ref, phase: str):
    """The ref's value, or _DIED when its actor died; any other failure raises as ray_get's one-line error."""
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(ref)
    except RayActorError:
        return _DIED
    except Exception:
        return ray_get(ref, phase)  # raises it again, as one GymvError line


@dataclass
class _Batch:
    index: int  # the step it was drawn for
    calls: list[RolloutCall] = field(default_factory=list)


@dataclass
class PipelineStats:
    dropped_trajectories: int = 0  # too old when a step would have taken them
    failed_calls: int = 0  # given up after max_attempts (their prompts were not trained on)
    retried_calls: int = 0
    worker_restarts: int = 0
    stale_encoder_hits: int = 0


class RolloutPipeline:
    def __init__(self, cluster, data: RowStream, buffer: ReplayBuffer, *, prompts_per_step: int, request: RolloutRequest,
                 max_steps: int, seed: int, start_step: int, max_attempts: int = 2):
        """`request`: every batch's rollout call, each batch with its own seed (of `seed` and the batch)."""
        self.cluster, self.data, self.buffer = cluster, data, buffer
        self.P, self.G, self.max_steps, self.seed = prompts_per_step, request.group_size, max_steps, seed
        self.request, self.max_attempts = request, max_attempts
        self.version = start_step  # newest weights queued to the generators
        self.next_batch = start_step + 1
        self.positions: dict[int, DataPosition] = {}  # data position right after drawing batch j
        self.stats = PipelineStats()
        self._inflight: list[tuple[_Batch, RolloutCall]] = []
        self._refits: list = []
        self._refills = 0
        self._done: list[tuple[int, float, float]] = []  # (worker, started_at, ended_at) of finished calls
        self._last_end: dict[int, float] = {}
        self._gen_s: list[float] = []  # per finished call, since the last `timings()`
        self._env_s: list[float] = []

    # -- producing -----------------------------------------------------------------------------------
    def outstanding_groups(self) -> int:
        return len(self.buffer) + sum(len(c.rows) for _, c in self._inflight)

    def fill(self) -> None:
        """Submit every batch the staleness bound and the buffer's room allow."""
        while (self.next_batch <= min(self.version + self.buffer.max_age + 1, self.max_steps)
               and self.outstanding_groups() + self.P <= self.buffer.capacity):
            self._submit(self.next_batch, step_seed(self.seed, self.next_batch))
            self.next_batch += 1

    def _submit(self, index: int, seed: int) -> None:
        rows = self.data.next_batch(self.P)
        self.positions[index] = self.data.position
        batch = _Batch(index)
        for call in self.cluster.submit_rollouts([(r.index, r.data) for r in rows], replace(self.request, seed=seed)):
            batch.calls.append(call)
            self._inflight.append((batch, call))

    def refit(self, version: int) -> None:
        """Queue the weights of `version` to the generators (call `fill` next to submit what that allows)."""
        self._refits += self.cluster.refit_async(version)
        self.version = version
        self._check_refits(block=False)

    def _check_refits(self, *, block: bool) -> None:
        """Surface a failed refit (a dead generator's queued refit is fine: the worker is replaced anyway)."""
        import ray

        if not self._refits:
            return
        n = len(self._refits)
        ready, self._refits = ray.wait(self._refits, num_returns=n, timeout=self._deadline() if block else 0)
        if block and len(ready) < n:
            self._late("refit")
        for ref in ready:
            _result(ref, "refit")

    def _deadline(self) -> float:
        return self.cluster.deadlines.phase_s

    def _late(self, phase: str) -> None:
        raise GymvError(f"{phase} did not finish within {self._deadline():g} s", where=phase, exit_code=1,
                        fix="see the workers' logs for a hang; a slower phase needs a larger cluster.phase_timeout_s")

    # -- consuming -----------------------------------------------------------------------------------
    def take(self, step: int) -> tuple[list[Group], int]:
        """(the groups step `step` trains on, trajectories dropped as too old).

        Groups are taken in data order, from batches whose every call has finished and with no older batch
        still running, so the same run takes the same groups whichever worker finishes first."""
        self._collect(block=False)
        dropped = self._drop(step)
        while self._settled() < self.P:
            if not self._inflight:  # nothing coming (dropped or failed): a replacement batch, newest weights
                self._refills += 1
                self._submit(step, step_seed(self.seed, step, f"refill{self._refills}"))
            self._collect(block=True)
            dropped += self._drop(step)
        groups = self.buffer.take(self.P)
        # the refits that gave these weights were checked (when due) before the step trains on their rollouts
        self.cluster.wait_checked(g.version for g in groups)
        return groups, dropped

    def _settled(self) -> int:
        """Buffered groups older than every batch still in flight."""
        running = min((b.index for b, _ in self._inflight), default=None)
        return self.buffer.count_before(running)

    def _drop(self, step: int) -> int:
        n = sum(len(g.trajectories) for g in self.buffer.prune(step))
        self.stats.dropped_trajectories += n
        return n

    def _collect(self, *, block: bool) -> None:
        """Process every finished call (waiting for at least one when `block`)."""
        import ray

        if not self._inflight:
            return
        refs = [c.ref for _, c in self._inflight]
        ready, _ = ray.wait(refs, num_returns=1, timeout=self._deadline() if block else 0)
        if block and not ready:
            self._late("generation")
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        finished = [(b, c) for b, c in self._inflight if c.ref in done]
        self._inflight = [(b, c) for b, c in self._inflight if c.ref not in done]
        lost: dict[int, list[tuple[_Batch, RolloutCall]]] = {}
        for batch, call in finished:
            out = _result(call.ref, "generation")
            if out is _DIED:
                lost.setdefault(call.worker, []).append((batch, call))
            else:
                self._finished(batch, call, out)
        for worker, calls in lost.items():
            self._recover(worker, calls)

    def _finished(self, batch: _Batch, call: RolloutCall, out: dict) -> None:
        self._done.append((call.worker, out["started_at"], out["ended_at"]))
        self._last_end[call.worker] = out["ended_at"]
        self._gen_s.append(out["seconds"])
        self._env_s.append(out["stats"].get("env_s", 0.0))
        self.stats.stale_encoder_hits += int(out["stats"].get("encoder_cache_stale_hits", 0))
        trajectories = out["trajectories"]
        version = int(out["weights_version"])
        self.buffer.add([Group(batch.index, version, trajectories[i:i + self.G])
                         for i in range(0, len(trajectories), self.G)])

    def _recover(self, worker: int, lost: list[tuple[_Batch, RolloutCall]]) -> None:
        """Replace a dead generation worker; resubmit its unfinished calls (oldest first) or give them up."""
        self.stats.worker_restarts += 1
        self.cluster.replace_generator(worker, self.version)
        self._last_end.pop(worker, None)
        queued = [(b, c) for b, c in self._inflight if c.worker == worker]  # their refs died with the worker
        self._inflight = [(b, c) for b, c in self._inflight if c.worker != worker]
        for b, c in sorted(lost + queued, key=lambda bc: bc[0].index):
            if c.attempts >= self.max_attempts:
                self.stats.failed_calls += 1
                continue
            self.stats.retried_calls += 1
            self._inflight.append((b, self.cluster.resubmit(c)))

    def close(self) -> None:
        """Wait for queued refits (so that a validation or export after the loop sees the newest weights)."""
        self._check_refits(block=True)

    # -- accounting ----------------------------------------------------------------------------------
    def timings(self) -> dict[str, float]:
        """The generation seconds and the longest env seconds of the calls finished since the last call, as
        the workers measured them (`timing/` keys for the step's PhaseTimer.take)."""
        out = {phase_key("generation"): sum(self._gen_s), phase_key("env"): max(self._env_s, default=0.0)}
        self._gen_s, self._env_s = [], []
        return out

    def overlap_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] (wall clock) during which some generation worker was busy.

        Finished calls report their own start and end; a call still running is taken to have started when
        its worker finished the previous call (or when it was submitted, if later)."""
        spans = [(a, b) for _, a, b in self._done if b > start and a < end]
        running: dict[int, float] = {}
        for _, c in self._inflight:
            if c.worker not in running:
                running[c.worker] = max(c.submitted_at, self._last_end.get(c.worker, 0.0))
        spans += [(a, end) for a in running.values() if a < end]
        self._done = [d for d in self._done if d[2] > start]
        merged: list[tuple[float, float]] = []
        for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return sum(b - a for a, b in merged if b > a)
