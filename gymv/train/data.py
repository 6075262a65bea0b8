"""Training data: rows from files or generated into the run directory, routed to environments, and a
stream whose order is a pure function of (seed, epoch), so a resumed run draws exactly the rows it would
have drawn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gymv.errors import GymvError
from gymv.io import iter_jsonl
from gymv.runs.checkpoint import DataPosition

DATA_DIR = "data"


@dataclass(frozen=True)
class Row:
    """One data row and where it came from (`index` is its position in the split: NeMo Gym's task index)."""

    index: int
    data: dict
    where: str


def read_rows(paths: str | Sequence[str] | None) -> list[Row]:
    """Rows of one or more JSONL files, in file order; an empty result is an error."""
    if paths is None:
        return []
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    rows: list[Row] = []
    for p in paths:
        for line, data in iter_jsonl(p):
            rows.append(Row(len(rows), data, f"{p} line {line}"))
    if not rows:
        raise GymvError("no rows", where=", ".join(map(str, paths)), fix="point data.train/data.eval at non-empty JSONL files")
    return rows


# ------------------------------------------------------------------------------------------------ routing


@dataclass(frozen=True)
class EnvSpec:
    """The configured environment, as every worker builds it (plain data, so it crosses process boundaries)."""

    name: str
    kwargs: dict = field(default_factory=dict)
    max_turns: int | None = None
    url: str | None = None  # a NeMo Gym / `gymv env serve` server; None = in-process
    timeout_s: float = 30.0
    retries: int = 2


class EnvRouter:
    """Row -> environment: the configured one, or the built-in/plugin one a row's `agent_ref.name` names.

    Instances are created once per process and reused (environments keep no per-rollout state outside
    their EpisodeState).
    """

    def __init__(self, spec: EnvSpec):
        from gymv.envs.registry import make_env

        self.spec = spec
        try:
            self.default = make_env({"name": spec.name, "url": spec.url, "max_turns": spec.max_turns,
                                     "timeout_s": spec.timeout_s, "retries": spec.retries, "kwargs": dict(spec.kwargs)})
        except GymvError as e:
            raise GymvError(e.message, where=e.where or ("env.url" if spec.url else "env.name"), fix=e.fix) from None
        self._by_agent: dict[str, Any] = {}

    def agent_of(self, row: dict) -> str | None:
        ref = row.get("agent_ref")
        name = ref.get("name") if isinstance(ref, dict) else None
        return name if isinstance(name, str) else None

    def __call__(self, row: dict, where: str | None = None):
        """The environment of `row`; an agent that names no installed environment is an error."""
        from gymv.envs.registry import available, get_env, normalize

        agent = self.agent_of(row)
        if agent is None or agent == self.default.agent_name or normalize(agent) == self.default.name:
            return self.default
        if agent in self._by_agent:
            return self._by_agent[agent]
        for name in available():
            if normalize(agent) == name:
                env = get_env(name)
                break
        else:
            env = None
            for name in available():
                try:
                    candidate = get_env(name)
                except GymvError:
                    continue
                if candidate.agent_name == agent:
                    env = candidate
                    break
        if env is None:
            raise GymvError(
                f"agent_ref.name {agent!r} names no environment this run can use (env.name is {self.spec.name!r})",
                where=where, fix=f"use rows of {self.default.agent_name!r}, set env.name to the rows' environment, "
                                 f"or install its plugin (available: {', '.join(available())})")
        self._by_agent[agent] = env
        return env

    def check(self, rows: Sequence[Row]) -> None:
        """Route every row once up front, so bad rows fail before any worker starts."""
        for r in rows:
            env = self(r.data, r.where)
            env.check_row(r.data, where=r.where)


# ------------------------------------------------------------------------------------------- generation


def _knob_strings(env: Any, preset: str, knobs: dict) -> list[str]:
    """Recipe knob values (YAML scalars or lists) as the `key=value` text `gymv prepare` takes."""
    base = env.presets.get(preset)
    out = []
    for key, value in knobs.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            current = getattr(base, str(key).replace("-", "_"), None)
            is_range = isinstance(current, tuple) and len(current) == 2 and all(isinstance(x, int) for x in current)
            text = (":" if is_range else ",").join(str(v) for v in value)
        else:
            text = str(value)
        out.append(f"{key}={text}")
    return out


def prepare_split(run_path: Path, cfg, split: str, n: int) -> Path:
    """Generate `n` rows of `split` into runs/<name>/data/<split>.jsonl with the env's generator.

    Train and eval rows come from disjoint seed ranges (gymv.data.generate). An existing file from an
    earlier launch of the same run is reused: generation is deterministic, so it holds the same rows.
    """
    from gymv.data.generate import write_dataset
    from gymv.envs import get_env
    from gymv.envs.knobs import resolve_knobs

    path = run_path / DATA_DIR / f"{split}.jsonl"
    if path.exists():
        return path
    prep = cfg.data.prepare
    env = get_env(cfg.env.name)
    preset = prep.preset or "default"
    knobs = resolve_knobs(env, preset, _knob_strings(env, preset, prep.knobs))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_dataset(path, env, knobs, n=n, split=split, seed=prep.seed)
    return path


def training_rows(cfg, run_path: Path) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows): from `data.train`/`data.eval`, else generated by `data.prepare`."""
    prep = cfg.data.prepare
    train_src = cfg.data.train
    if train_src is None:
        if prep is None:
            raise GymvError("no training data: data.train is null and data.prepare is off", where="data",
                            fix="set data.train to a JSONL file or turn data.prepare on")
        train_src = str(prepare_split(run_path, cfg, "train", prep.n_train))
    eval_src = cfg.data.eval
    if eval_src is None and prep is not None and prep.n_eval > 0:
        eval_src = str(prepare_split(run_path, cfg, "eval", prep.n_eval))
    return read_rows(train_src), read_rows(eval_src)


# ----------------------------------------------------------------------------------------------- stream


def epoch_order(n: int, shuffle_seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The row order of one epoch: a pure function of (n, seed, epoch)."""
    order = list(range(n))
    if shuffle:
        random.Random(f"gymv-data:{shuffle_seed}:{epoch}").shuffle(order)
    return order


class RowStream:
    """Batches of rows in epoch order; `position` is all a checkpoint needs to continue the stream."""

    def __init__(self, rows: Sequence[Row], *, seed: int, shuffle: bool = True, position: DataPosition | None = None):
        if not rows:
            raise GymvError("no training rows", fix="check data.train or data.prepare.n_train")
        self.rows = list(rows)
        self.shuffle = shuffle
        self.position = position or DataPosition(epoch=0, index=0, shuffle_seed=seed)
        self._order_epoch = -1
        self._order: list[int] = []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = epoch_order(len(self.rows), self.position.shuffle_seed, epoch, self.shuffle)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[Row]:
        """The next `n` rows; an epoch that runs out continues into the next one."""
        out: list[Row] = []
        pos = self.position
        while len(out) < n:
            order = self._order_of(pos.epoch)
            take = order[pos.index:pos.index + (n - len(out))]
            out.extend(self.rows[i] for i in take)
            pos = DataPosition(pos.epoch, pos.index + len(take), pos.shuffle_seed)
            if pos.index >= len(order):
                pos = DataPosition(pos.epoch + 1, 0, pos.shuffle_seed)
        self.position = pos
        return out
