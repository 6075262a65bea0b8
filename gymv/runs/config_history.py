"""A run's config over its life: config.yaml is what the run started with and is never rewritten; each
launch that changed something (`gymv train --resume DIR grpo.max_steps=80`) appends its changes to
config_changes.jsonl, so the weights can always be traced to the settings that trained them.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gymv.io import file_mode

CHANGES_FILE = "config_changes.jsonl"
ABSENT = "<absent>"
# how a launch runs, not what it trains: these may differ between launches of one run without a refusal
# where and how a launch runs, not what it trains: a run continues under new values of these (a prefix
# ending in "." covers every key below it, e.g. a role's node pins on a new allocation)
LAUNCH_KEYS = ("checkpoint.steps_per_run", "checkpoint.resume", "cluster.ray_address", "cluster.placement.",
               "cluster.connect_timeout_s", "cluster.placement_timeout_s", "cluster.start_timeout_s",
               "cluster.phase_timeout_s", "cluster.max_restarts")


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys; a mapping is walked into (an empty one is a leaf), a list is a leaf."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def diff(old: Mapping[str, Any], new: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs, in key order; ABSENT marks a missing side."""
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ignore or any(k.endswith(".") and key.startswith(k) for k in ignore):
            continue
        va, vb = a.get(key, ABSENT), b.get(key, ABSENT)
        if va != vb:
            out.append((key, va, vb))
    return out


def describe(changes: list[tuple[str, Any, Any]], limit: int = 3) -> str:
    """`training.lr 0.0002 -> 0.001, grpo.max_steps 40 -> 80 (+2 more)`: one line for an error or a notice."""
    def show(v: Any) -> str:
        return v if v is ABSENT else json.dumps(v)

    text = ", ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in changes[:limit])
    return text + (f" (+{len(changes) - limit} more)" if len(changes) > limit else "")


def _set(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if value is ABSENT:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def read_changes(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / CHANGES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def apply_changes(config: Mapping[str, Any], entries: list[dict]) -> dict:
    """The run's current config: config.yaml with every recorded change applied in order."""
    out = copy.deepcopy(dict(config))
    for entry in entries:
        for key, (_, new) in entry["changes"].items():
            _set(out, key, new)
    return out


def change_overrides(entries: list[dict]) -> list[str]:
    """The recorded changes as `++key=value` overrides (values in JSON, which YAML reads back as written)."""
    latest: dict[str, Any] = {}
    for entry in entries:
        for key, (_, new) in entry["changes"].items():
            latest[key] = new
    return [f"~{k}" if v == ABSENT else f"++{k}={json.dumps(v)}" for k, v in latest.items()]


def append_changes(run_dir: str | Path, changes: list[tuple[str, Any, Any]]) -> None:
    """Record one launch's changes (one JSON line, appended and fsynced)."""
    import os

    path = Path(run_dir) / CHANGES_FILE
    line = json.dumps({"time": time.time(), "changes": {k: [a, b] for k, a, b in changes}}, separators=(",", ":"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, file_mode())
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
