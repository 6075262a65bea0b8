"""metrics.jsonl: one JSON object per step, appended and fsynced, readable while the run writes it.

A run killed mid-write leaves at most a truncated last line; readers skip it and the next writer cuts it
off before appending, so the file never holds a broken line in the middle.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.io import atomic_open, parse_json_line

RESERVED = ("step", "wall_time")


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; NaN/inf to None (strict JSON has no NaN)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise GymvError("metric value has more than one element", fix="log a scalar") from None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _repair_tail(path: Path) -> None:
    """Cut a partial last line (no trailing newline) left by a crash."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        cut = f.read().rfind(b"\n") + 1
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())


class MetricsLog:
    """Appends `{"step", "wall_time", **metrics}` per call; every line is flushed and fsynced."""

    def __init__(self, path: str | os.PathLike, sinks: Sequence[Any] = ()):
        """`sinks` (gymv.loggers: TensorBoard, W&B...) receive each row after it is safely in the file."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, Any], *, wall_time: float | None = None) -> dict:
        clash = [k for k in metrics if k in RESERVED]
        if clash:
            raise GymvError(f"metric names {clash} are reserved", where=str(self.path), fix="rename the metric")
        row = {"step": int(step), "wall_time": time.time() if wall_time is None else float(wall_time)}
        row.update({str(k): _plain(v) for k, v in metrics.items()})
        try:
            line = json.dumps(row, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise GymvError(f"metrics of step {step} are not JSON-serialisable: {e}", where=str(self.path),
                            fix="log numbers, strings or lists") from None
        self._f.write(line + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._to_sinks(int(step), row)
        return row

    def _to_sinks(self, step: int, row: dict) -> None:
        """A sink that fails is switched off with one warning: metrics.jsonl already holds the row."""
        for sink in list(self.sinks):
            try:
                sink.log(step, row)
            except Exception as e:
                self.sinks.remove(sink)
                print(f"warning: logger {getattr(sink, 'name', type(sink).__name__)} failed at step {step} and is "
                      f"switched off ({type(e).__name__}: {e}); metrics.jsonl has every metric", file=sys.stderr)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:
                print(f"warning: logger {getattr(sink, 'name', type(sink).__name__)} failed to close: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | os.PathLike, skipped: list[tuple[int, str]] | None = None) -> list[dict]:
    """All step rows in file order. A truncated last line is skipped; a broken line elsewhere is an error,
    or, given `skipped`, is left out and noted there as (line number, what is wrong) (the report: one bad
    line must not hide every good one)."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise GymvError("metrics file not found", where=str(path), fix="check the run directory") from None
    except OSError as e:
        raise GymvError(f"cannot read: {e.strerror}", where=str(path), fix="check that the file is readable") from None
    lines = text.split(b"\n")
    complete = text.endswith(b"\n")
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json_line(line)
            _check_step(row)
        except ValueError as e:
            if n == len(lines) and not complete:
                break
            if skipped is not None:
                skipped.append((n, str(e)))
                continue
            raise GymvError(f"malformed metrics line: {e}", where=f"{path}:{n}",
                            fix="delete or repair that line") from None
        rows.append(row)
    return rows


def _check_step(row: dict) -> None:
    """Every row has the step it belongs to, a whole number >= 0 (readers compare and sort by it)."""
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError("no `step`" if "step" not in row else
                         f"`step` is {json.dumps(step)[:40]}, not a whole number >= 0")


def truncate_metrics_after(path: str | os.PathLike, step: int) -> int:
    """Keep only rows with step <= `step` (atomically); returns how many rows were kept.

    Used on resume: steps after the restored checkpoint will be run and logged again.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if int(r.get("step", -1)) <= step]
    with atomic_open(path, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    return len(kept)
