"""The one clock of a training step: every `timing/*` key of a metrics row comes out of a `PhaseTimer`.

    timer = PhaseTimer()
    with timer.phase("generation"):                  # a phase the driver runs: timing/generation_s
        trajectories, worker_timing = cluster.rollouts(...)
    timer.take(worker_timing)                         # seconds measured inside the workers, as they sent them
    timer.rate("tokens", n_tokens, per="step")        # timing/tokens_per_s, once the step's clock stops
    timer.stop()                                      # timing/step_s
    row = {**metrics, **timer.metrics()}

A Ray worker times its own phases with a PhaseTimer too and sends `timer.metrics()` back in its result; the
driver's `take` moves them into the step's timer. So the names are made in one place (`timing/<phase>_s`,
`timing/<name>_per_s`) and a row's timing keys are exactly the timer's record of the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

PREFIX, SUFFIX, RATE_SUFFIX = "timing/", "_s", "_per_s"


def phase_key(name: str) -> str:
    """The metric of phase `name` (`generation/render` -> `timing/generation/render_s`)."""
    return f"{PREFIX}{name}{SUFFIX}"


class PhaseTimer:
    """Seconds of one step and of its named phases, in the manner of verl's `marked_timer`.

    `started`: when the step's clock started (`time.perf_counter()`; default now). A phase that runs twice (or
    is taken from several results) adds up; phases may nest (reference inside logprobs) or overlap (env inside
    generation): each is its own figure, and which of them stack is the reader's choice (gymv.report)."""

    def __init__(self, started: float | None = None, on_phase: Callable[[str], None] | None = None):
        self.started = time.perf_counter() if started is None else started
        self.on_phase = on_phase  # told each phase's name as it starts (a display: what a long step is doing)
        self.stopped: float | None = None
        self._seconds: dict[str, float] = {}
        self._rates: dict[str, tuple[float, str]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name`."""
        self.announce(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def announce(self, name: str) -> None:
        """Phase `name` starts; for a phase timed elsewhere (a worker's), which `take` brings in later."""
        if self.on_phase is not None:
            self.on_phase(name)

    def add(self, name: str, seconds: float) -> None:
        """Seconds of phase `name` that were measured elsewhere (the rollout pipeline, across a step's calls)."""
        self._seconds[name] = self._seconds.get(name, 0.0) + float(seconds)

    def take(self, result: dict) -> dict:
        """Move the `timing/<phase>_s` entries of a worker's result (its own timer's `metrics()`, or what its
        backend timed) into this timer; the result without them."""
        for key in [k for k in result if k.startswith(PREFIX)]:
            name = key[len(PREFIX):]
            if not name.endswith(SUFFIX) or name.endswith(RATE_SUFFIX):
                raise ValueError(f"{key}: a worker sends seconds (timing/<phase>_s); rates are the driver's")
            self.add(name[:-len(SUFFIX)], result.pop(key))
        return result

    def rate(self, name: str, count: float, *, per: str) -> None:
        """`timing/<name>_per_s`: `count` per second of phase `per` ("step": the whole step), reported once
        that phase's seconds are known."""
        self._rates[name] = (float(count), per)

    def stop(self) -> float:
        """Stop the step's clock (`timing/step_s`; only the first call counts); the step's seconds."""
        if self.stopped is None:
            self.stopped = time.perf_counter()
            self._seconds["step"] = self.stopped - self.started
        return self._seconds["step"]

    @property
    def seconds(self) -> dict[str, float]:
        """The phases recorded so far, by name (the step's own as "step" once stopped)."""
        return dict(self._seconds)

    def metrics(self) -> dict[str, float]:
        """Every recorded phase as `timing/<phase>_s`, and every rate whose phase was recorded."""
        out = {phase_key(name): s for name, s in self._seconds.items()}
        for name, (count, per) in self._rates.items():
            if per in self._seconds:
                out[f"{PREFIX}{name}{RATE_SUFFIX}"] = count / max(self._seconds[per], 1e-9)
        return out


def step_row(metrics: Mapping[str, float], timer: PhaseTimer) -> dict[str, float]:
    """A metrics row: the algorithm's metrics and the timer's. A `timing/` key made anywhere else is refused, so
    that every duration in a row was measured by the step's timer (and none is counted twice or missed)."""
    made = sorted(k for k in metrics if k.startswith(PREFIX))
    if made:
        raise ValueError(f"{', '.join(made)}: timing keys come from the step's PhaseTimer "
                         "(timer.phase, timer.add, or timer.take of a worker's result)")
    return {**metrics, **timer.metrics()}
