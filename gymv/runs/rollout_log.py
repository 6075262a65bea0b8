"""Rollout logs in NeMo Gym's rollout format: rollouts/step_<N>.jsonl (val: val_step_<N>.jsonl).

Each line is the data row plus `response` (a Responses-API object whose `output` holds message,
function_call, function_call_output and reasoning items) and `reward`, then verifier extras and
`_ng_task_index` / `_ng_rollout_index`, so `gymv env verify`, NeMo Gym tooling and `gymv report` read
them as they read NeMo Gym's own. For training, the last output item of each model call carries
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gymv.envs.responses import response_object
from gymv.errors import GymvError
from gymv.io import iter_jsonl, write_jsonl

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
SPLITS = {"train": "step_{}.jsonl", "val": "val_step_{}.jsonl"}
_FILE = re.compile(r"^(val_)?step_(\d+)\.jsonl$")


def attach_model_call_tokens(
    call_items: list[dict],
    prompt_token_ids: Sequence[int],
    generation_token_ids: Sequence[int],
    generation_log_probs: Sequence[float],
) -> list[dict]:
    """Put one model call's token record on the last of the output items that call produced (in place)."""
    if not call_items:
        raise GymvError("a model call produced no output items", where="rollout log",
                        fix="record at least the assistant message")
    if len(generation_token_ids) != len(generation_log_probs):
        raise GymvError(
            f"{len(generation_token_ids)} generated tokens but {len(generation_log_probs)} logprobs",
            where="rollout log", fix="record one logprob per generated token",
        )
    last = call_items[-1]
    last["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
    last["generation_token_ids"] = [int(t) for t in generation_token_ids]
    last["generation_log_probs"] = [float(x) for x in generation_log_probs]
    return call_items


def make_rollout_record(
    row: Mapping[str, Any],
    output: list[dict],
    reward: float,
    *,
    model: str | None = None,
    extras: Mapping[str, Any] | None = None,
    task_index: int | None = None,
    rollout_index: int | None = None,
    usage: Mapping[str, Any] | None = None,
) -> dict:
    """One rollout line: the row's fields, a Responses-API `response`, the reward, extras and indices."""
    params = row.get("responses_create_params", {})
    response = response_object(output, params=params, model=model, usage=usage)
    record: dict[str, Any] = {"responses_create_params": params, "response": response, "reward": float(reward)}
    record.update(extras or {})
    for k, v in row.items():
        if k not in record and k not in ("response", "reward"):
            record[k] = v
    if task_index is not None:
        record["_ng_task_index"] = int(task_index)
    if rollout_index is not None:
        record["_ng_rollout_index"] = int(rollout_index)
    return record


def model_calls(record: Mapping[str, Any]) -> list[dict[str, list]]:
    """Token records of each model call, in order (the output items that carry TOKEN_FIELDS)."""
    return [{k: item[k] for k in TOKEN_FIELDS} for item in record["response"]["output"] if "generation_token_ids" in item]


def validate_rollout(record: Mapping[str, Any], where: str) -> None:
    response = record.get("response")
    if not isinstance(response, Mapping) or not isinstance(response.get("output"), list):
        raise GymvError("rollout lacks response.output", where=where, fix="log the Responses-API response object")
    reward = record.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise GymvError(f"rollout reward must be a finite number, got {reward!r}", where=where,
                        fix="score the rollout before logging it")
    for n, item in enumerate(response["output"]):
        if not isinstance(item, Mapping) or "type" not in item:
            raise GymvError(f"output item {n} has no 'type'", where=where,
                            fix="give every output item a type (message, function_call, ...)")
        present = [k for k in TOKEN_FIELDS if k in item]
        if present and len(present) != len(TOKEN_FIELDS):
            raise GymvError(f"output item {n} has only {present} of {list(TOKEN_FIELDS)}", where=where,
                            fix="use attach_model_call_tokens")
        if present and len(item["generation_token_ids"]) != len(item["generation_log_probs"]):
            raise GymvError(f"output item {n}: token ids and logprobs differ in length", where=where,
                            fix="give one logprob per generated token")


def rollout_path(run_dir: str | os.PathLike, step: int, split: str = "train") -> Path:
    if split not in SPLITS:
        raise GymvError(f"unknown rollout split {split!r}", fix=f"use one of {sorted(SPLITS)}")
    return Path(run_dir) / "rollouts" / SPLITS[split].format(int(step))


def write_rollouts(run_dir: str | os.PathLike, step: int, records: Iterable[Mapping[str, Any]], split: str = "train") -> Path:
    """Validate and atomically write one step's rollouts; returns the file path."""
    path = rollout_path(run_dir, step, split)
    records = list(records)
    for n, r in enumerate(records):
        validate_rollout(r, where=f"{path.name} record {n}")
    write_jsonl(path, records)
    return path


def read_rollouts(path: str | os.PathLike) -> list[dict]:
    return [row for _, row in iter_jsonl(path)]


def rollout_files(run_dir: str | os.PathLike, split: str = "train") -> list[tuple[int, Path]]:
    """(step, path) of one split's rollout files, by step."""
    d = Path(run_dir) / "rollouts"
    if not d.is_dir():
        return []
    out = []
    for f in d.iterdir():
        m = _FILE.match(f.name)
        if m and (m.group(1) is not None) == (split == "val"):
            out.append((int(m.group(2)), f))
    return sorted(out)
