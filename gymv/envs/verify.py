"""Re-score rollout files with gymv's verifiers, and aggregate verify results like NeMo Gym's /aggregate_metrics.

NeMo Gym's rollout files often leave out the verifier fields (circles, target_color, ...) and keep only
`_ng_task_index`, the row's position in the dataset it was run on; passing that dataset joins them back.
A reward of 0 is the model's failure and is counted by reason; a rollout that cannot be scored at all
(bad JSON, missing fields, no matching environment) is the data's and is an error naming its line.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv.envs.protocol import Environment
from gymv.envs.registry import env_for_row, get_env
from gymv.errors import GymvError
from gymv.io import iter_jsonl, write_jsonl

TASK_INDEX = "_ng_task_index"
ROLLOUT_INDEX = "_ng_rollout_index"


@dataclass
class EnvTally:
    rollouts: int = 0
    reward_sum: float = 0.0
    recorded: int = 0
    recorded_sum: float = 0.0
    mismatches: int = 0

    def as_dict(self) -> dict:
        return {
            "rollouts": self.rollouts,
            "mean_reward": self.reward_sum / self.rollouts if self.rollouts else None,
            "recorded_mean_reward": self.recorded_sum / self.recorded if self.recorded else None,
            "mismatches": self.mismatches,
        }


@dataclass
class VerifyReport:
    path: str
    lines: int = 0
    scored: int = 0
    reward_sum: float = 0.0
    by_env: dict[str, EnvTally] = field(default_factory=dict)
    failures: Counter = field(default_factory=Counter)
    mismatches: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        return self.reward_sum / self.scored if self.scored else None

    @property
    def recorded_mean_reward(self) -> float | None:
        n = sum(t.recorded for t in self.by_env.values())
        return sum(t.recorded_sum for t in self.by_env.values()) / n if n else None

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "rollouts": self.lines,
            "scored": self.scored,
            "mean_reward": self.mean_reward,
            "recorded_mean_reward": self.recorded_mean_reward,
            "by_env": {name: t.as_dict() for name, t in sorted(self.by_env.items())},
            "failures": dict(sorted(self.failures.items())),
            "mismatches": self.mismatches,
            "errors": self.errors,
        }


class _DataRows:
    """The dataset rollouts were run on, indexed like NeMo Gym's `_ng_task_index` (0-based, blank lines skipped)."""

    def __init__(self, path: str | os.PathLike, on_error: str):
        self.path = Path(path)
        skipped: list[tuple[int, str]] = []
        found: dict[int, dict | str] = dict(iter_jsonl(self.path, on_error=on_error, errors=skipped,
                                                       skip_option="--on-error skip"))
        found.update((lineno, f"{self.path}:{lineno}: {msg}") for lineno, msg in skipped)
        # a string holds why that row is unusable; it keeps its place, so later rows keep their index
        self.rows: list[dict | str] = [found[lineno] for lineno in sorted(found)]

    def get(self, index: object, where: str) -> dict:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.rows):
            raise GymvError(f"{TASK_INDEX}={index!r} is not a row of {self.path} ({len(self.rows)} rows)", where=where,
                            fix="pass the dataset these rollouts were generated from")
        row = self.rows[index]
        if isinstance(row, str):
            raise GymvError(f"its data row {index} is unusable ({row})", where=where,
                            fix="fix that data row, or pass --data rows that hold the verifier fields")
        return row


def _needs_join(rollout: dict, env: Environment | None) -> bool:
    env = env or env_for_row(rollout)  # found by agent_ref, it may still lack its verifier fields
    if env is not None:
        return any(k not in rollout for k in env.verifier_fields)
    return True


def score_rollout(rollout: dict, *, env: Environment | None = None, data: _DataRows | None = None,
                  where: str = "rollout") -> tuple[Environment, dict]:
    """(environment, verify result) for one rollout; GymvError when the data cannot be scored."""
    row = rollout
    if _needs_join(rollout, env):
        if TASK_INDEX not in rollout:
            missing = next((k for k in env.verifier_fields if k not in rollout), None) if env else None
            what = f"is missing the verifier field {missing!r} that {env.name} needs" if missing else "has no verifier fields"
            raise GymvError(f"rollout {what} and no _ng_task_index to find its data row", where=where,
                            fix="score rollouts that carry the row's fields, or ones with _ng_task_index plus --data")
        if data is None:
            raise GymvError("rollout has no verifier fields; its data row is needed", where=where,
                            fix="pass the dataset it was run on with --data ROWS.jsonl")
        row = {**data.get(rollout[TASK_INDEX], where), **rollout}
    if env is None:
        env = env_for_row(row)
        if env is None:
            raise GymvError("cannot tell which environment scores this rollout (no agent_ref, no known fields)",
                            where=where, fix="pass --env NAME")
    return env, env.verify(row, where=where)


def verify_rollouts(
    rollouts: str | os.PathLike,
    *,
    data: str | os.PathLike | None = None,
    env: str | None = None,
    on_error: str = "fail",
    out: str | os.PathLike | None = None,
) -> VerifyReport:
    """Re-score every rollout in a JSONL file; with `out`, also write the scored rollouts there (atomically)."""
    fixed = get_env(env) if env else None
    rows = _DataRows(data, on_error) if data is not None else None
    report = VerifyReport(path=str(rollouts))
    parse_errors: list = []
    scored_rows: list[dict] = []
    for lineno, rollout in iter_jsonl(rollouts, on_error=on_error, errors=parse_errors, skip_option="--on-error skip"):
        report.lines += 1
        where = f"{rollouts}:{lineno}"
        try:
            recorded = rollout.get("reward")
            if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, (int, float))
                                         or not math.isfinite(recorded)):
                raise GymvError(f"the recorded reward {str(recorded)[:40]!r} is not a finite number", where=where,
                                fix="repair the line, or drop its reward field to score it afresh")
            environment, result = score_rollout(rollout, env=fixed, data=rows, where=where)
        except GymvError as e:
            if on_error == "fail":
                raise
            report.errors.append({"line": lineno, "error": e.one_line()})
            continue
        report.scored += 1
        report.reward_sum += result["reward"]
        tally = report.by_env.setdefault(environment.name, EnvTally())
        tally.rollouts += 1
        tally.reward_sum += result["reward"]
        if result.get("failure_reason"):
            report.failures[result["failure_reason"]] += 1
        recorded = rollout.get("reward")
        if isinstance(recorded, (int, float)) and not isinstance(recorded, bool):
            tally.recorded += 1
            tally.recorded_sum += recorded
            if not math.isclose(recorded, result["reward"], abs_tol=1e-9):
                tally.mismatches += 1
                report.mismatches.append({"line": lineno, "recorded": recorded, "gymv": result["reward"]})
        if out is not None:
            scored_rows.append(result)
    for lineno, msg in parse_errors:
        report.lines += 1
        report.errors.append({"line": lineno, "error": f"{rollouts}:{lineno}: {msg}"})
    report.errors.sort(key=lambda e: e["line"])
    if out is not None:
        write_jsonl(out, scored_rows)
    return report


# ---------------------------------------------------------------------------------- aggregate metrics


def _numeric_fields(vr: dict) -> dict[str, float]:
    values: dict[str, float] = {}
    for k, v in vr.items():
        if k in (TASK_INDEX, ROLLOUT_INDEX):
            continue
        if isinstance(v, (bool, int, float)) and (x := _finite(v)) is not None:
            values[k] = x
    usage = (vr.get("response") or {}).get("usage") if isinstance(vr.get("response"), dict) else None
    if isinstance(usage, dict):
        for k in ("input_tokens", "output_tokens", "total_tokens"):
            v = usage.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (x := _finite(v)) is not None:
                values[k] = x
    return values


def _finite(v: bool | int | float) -> float | None:
    """v as a finite float; None for NaN, infinities and ints beyond a float's range."""
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _mean(xs: list[float]) -> float:
    try:
        return statistics.fmean(xs)
    except OverflowError:  # the sum leaves a float's range; the mean of finite values does not
        return math.fsum(x / len(xs) for x in xs)


def _stdev(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    try:
        return statistics.stdev(xs)
    except OverflowError:  # the squares leave a float's range: compute on values scaled to at most 1
        scale = max(abs(x) for x in xs)
        return statistics.stdev([x / scale for x in xs]) * scale


def _stats(samples: list[dict[str, float]]) -> dict[str, float]:
    keys: list[str] = []
    for s in samples:
        keys.extend(k for k in s if k not in keys)
    out: dict[str, float] = {}
    for stat in ("mean", "max", "min", "median", "std"):
        for k in keys:
            xs = [s[k] for s in samples if k in s]
            if stat == "mean":
                out[f"mean/{k}"] = _mean(xs)
            elif stat == "max":
                out[f"max/{k}"] = max(xs)
            elif stat == "min":
                out[f"min/{k}"] = min(xs)
            elif stat == "median":
                out[f"median/{k}"] = statistics.median(xs)
            else:
                out[f"std/{k}"] = _stdev(xs)
    return out


def aggregate_metrics(verify_responses: list[Any]) -> dict:
    """Mean, max, min, median and (sample) std of every numeric field, overall and per task.

    The result has NeMo Gym's keys: `agent_metrics` (all rollouts), `key_metrics` (the means) and
    `group_level_metrics` (one entry per `_ng_task_index`, sorted).
    """
    if not isinstance(verify_responses, list) or not all(isinstance(v, dict) for v in verify_responses):
        raise GymvError("verify_responses must be a list of objects", fix='send {"verify_responses": [{...}, ...]}')
    if not verify_responses:
        return {"group_level_metrics": [], "agent_metrics": {}, "key_metrics": {}}
    samples = [_numeric_fields(v) for v in verify_responses]
    agent = _stats(samples)
    groups: dict[Any, list[dict[str, float]]] = {}
    for v, s in zip(verify_responses, samples):
        task = v.get(TASK_INDEX, 0)
        groups.setdefault(task if isinstance(task, int) else 0, []).append(s)
    group_level = [{**_stats(groups[t]), TASK_INDEX: t} for t in sorted(groups)]
    return {
        "group_level_metrics": group_level,
        "agent_metrics": agent,
        "key_metrics": {k: v for k, v in agent.items() if k.startswith("mean/")},
    }
