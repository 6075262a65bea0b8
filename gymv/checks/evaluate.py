"""Evaluate parsed checks against the metrics a run logged (metrics.jsonl), by walking the tree.

A statistic reads one metric's series (its values by step, nulls skipped), narrowed by `steps=A:B`
(inclusive step numbers), then by `first=N` / `last=N` (the first or last N of what is left, fewer when
fewer were logged). `ratio_above(m, t)` is the share of values strictly above t. Every arithmetic result
must stay finite and within ±MAX_MAGNITUDE; division by zero is an error, never inf.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.checks.syntax import (
    BinOp,
    BoolOp,
    Call,
    Check,
    CheckError,
    Compare,
    Node,
    Not,
    Num,
    Unary,
    parse_check,
)
from gymv.errors import GymvError
from gymv.runs.metrics import read_metrics

MAX_MAGNITUDE = 1e100


class CheckEvalError(CheckError):
    kind = "evaluation"


class MetricSeries:
    """Each metric's (step, value) pairs in step order, from metrics.jsonl rows."""

    def __init__(self, rows: Iterable[Mapping]):
        by_name: dict[str, dict[int, float]] = {}
        self.steps: set[int] = set()
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            self.steps.add(step)
            for k, v in row.items():
                if k in ("step", "wall_time"):
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    by_name.setdefault(k, {})
                    continue
                by_name.setdefault(k, {})[step] = float(v)  # a step logged twice: the later row wins
        self._series = {k: sorted(v.items()) for k, v in by_name.items()}

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike) -> MetricSeries:
        """The metrics of a run directory (or a metrics.jsonl path); a run still writing is fine."""
        p = Path(run_dir)
        path = p if p.is_file() else p / "metrics.jsonl"
        if not path.exists():
            return cls([])
        return cls(read_metrics(path))

    @property
    def names(self) -> list[str]:
        return sorted(self._series)

    @property
    def last_step(self) -> int | None:
        return max(self.steps) if self.steps else None

    def __contains__(self, name: str) -> bool:
        return name in self._series

    def series(self, name: str) -> list[tuple[int, float]]:
        return list(self._series.get(name, []))

    def values(self, name: str) -> list[float]:
        """The metric's values in step order (what a learning curve or a statistic reads)."""
        return [v for _, v in self._series.get(name, [])]


@dataclass(frozen=True)
class Observed:
    """The value one statistic call took (shown beside the check)."""

    text: str
    value: float
    count: int  # values it was computed from


@dataclass(frozen=True)
class CheckResult:
    text: str
    status: str  # pass | fail | error
    observed: tuple[Observed, ...] = ()
    error: str | None = None
    where: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def observed_text(self) -> str:
        return ", ".join(f"{o.text} = {o.value:.4g}" for o in self.observed)

    def to_dict(self) -> dict:
        return {"check": self.text, "status": self.status, "where": self.where, "error": self.error,
                "observed": [{"expr": o.text, "value": o.value, "count": o.count} for o in self.observed]}


def _bounded(value: float, node: Node, text: str) -> float:
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CheckEvalError(f"`{node.span(text)}` is out of range (|value| > {MAX_MAGNITUDE:g})", text, node.pos)
    return value


class _Evaluator:
    def __init__(self, check: Check, metrics: MetricSeries):
        self.check, self.text, self.metrics = check, check.text, metrics
        self.observed: list[Observed] = []

    def value(self, node: Node):
        if isinstance(node, Num):
            return node.value
        if isinstance(node, Call):
            return self.call(node)
        if isinstance(node, Unary):
            v = self.value(node.operand)
            return -v if node.op == "-" else v
        if isinstance(node, BinOp):
            a, b = self.value(node.left), self.value(node.right)
            if node.op == "+":
                r = a + b
            elif node.op == "-":
                r = a - b
            elif node.op == "*":
                r = a * b
            else:
                if b == 0:
                    raise CheckEvalError(f"division by zero in `{node.span(self.text)}`", self.text, node.right.pos)
                r = a / b
            return _bounded(r, node, self.text)
        if isinstance(node, Compare):
            vals = [self.value(o) for o in node.operands]
            return all(_compare(op, vals[i], vals[i + 1]) for i, op in enumerate(node.ops))
        if isinstance(node, BoolOp):
            vals = [self.value(v) for v in node.values]  # all evaluated, so every statistic is reported
            return all(vals) if node.op == "and" else any(vals)
        if isinstance(node, Not):
            return not self.value(node.operand)
        raise CheckEvalError(f"cannot evaluate `{node.span(self.text)}`", self.text, node.pos)

    def call(self, node: Call) -> float:
        name = node.metric.name
        if name not in self.metrics:
            logged = self.metrics.names
            import difflib

            near = difflib.get_close_matches(name, logged, n=1, cutoff=0.6)
            hint = f"; did you mean `{near[0]}`?" if near else (f"; the run logged {len(logged)} metrics" if logged
                                                                 else "; the run logged no metrics yet")
            raise CheckEvalError(f"metric `{name}` was never logged{hint}", self.text, node.metric.pos,
                                 fix="check the metric name (docs/algorithms.md §10), or that the run got that far")
        series = self.metrics.series(name)
        if node.steps is not None:
            lo, hi = node.steps
            series = [(s, v) for s, v in series if (lo is None or s >= lo) and (hi is None or s <= hi)]
        if node.first is not None:
            series = series[:node.first]
        if node.last is not None:
            series = series[-node.last:]
        vals = [v for _, v in series]
        if not vals:
            all_steps = [s for s, _ in self.metrics.series(name)]
            span = f"steps {all_steps[0]}..{all_steps[-1]}" if all_steps else "no step (only nulls)"
            raise CheckEvalError(f"no values of `{name}` selected by `{node.span(self.text)}` (it was logged at {span})",
                                 self.text, node.pos, fix="widen steps=, or let the run log more steps")
        if node.func == "mean":
            r = math.fsum(vals) / len(vals)
        elif node.func == "median":
            r = statistics.median(vals)
        elif node.func == "min":
            r = min(vals)
        elif node.func == "max":
            r = max(vals)
        elif node.func == "ratio_above":
            threshold = self.value(node.args[0])
            r = sum(v > threshold for v in vals) / len(vals)
        else:
            raise CheckEvalError(f"unknown function `{node.func}`", self.text, node.pos)
        r = _bounded(float(r), node, self.text)
        self.observed.append(Observed(node.span(self.text), r, len(vals)))
        return r


def _compare(op: str, a: float, b: float) -> bool:
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op]


def evaluate_check(check: Check | str, metrics: MetricSeries, *, where: str | None = None) -> CheckResult:
    """Pass, fail, or error (a syntax error, a metric never logged, nothing selected, a value out of range)."""
    text = check.text if isinstance(check, Check) else check
    try:
        parsed = check if isinstance(check, Check) else parse_check(check)
    except CheckError as e:
        return CheckResult(text, "error", (), f"{e.reason} at column {e.pos + 1}", where)
    ev = _Evaluator(parsed, metrics)
    try:
        ok = ev.value(parsed.tree)
    except CheckError as e:
        return CheckResult(text, "error", tuple(ev.observed), f"{e.reason} at column {e.pos + 1}", where)
    return CheckResult(text, "pass" if ok else "fail", tuple(ev.observed), None, where)


def evaluate_checks(checks: Sequence[str | Check], metrics: MetricSeries | str | os.PathLike,
                    wheres: Sequence[str | None] | None = None) -> list[CheckResult]:
    """Evaluate several checks against a MetricSeries or a run directory."""
    if not isinstance(metrics, MetricSeries):
        metrics = MetricSeries.from_run(metrics)
    wheres = list(wheres) if wheres is not None else [None] * len(checks)
    if len(wheres) != len(checks):
        raise GymvError("one location per check is needed", where="evaluate_checks",
                        fix="pass one location per check text")
    return [evaluate_check(c, metrics, where=w) for c, w in zip(checks, wheres)]
