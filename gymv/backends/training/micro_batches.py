"""Token-budget micro-batching and the default padding collate.

A micro-batch costs its padded size, n_samples x longest sample. Sorting by length (longest first) and
filling greedily keeps samples of similar length together, so little of the budget is spent on padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from gymv.errors import GymvError

DEFAULT_PAD_VALUES: Mapping[str, float | int | bool] = {"input_ids": 0, "loss_mask": False, "attention_mask": 0}


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists whose padded token count (count x max length) stays <= max_tokens.

    Longest first, ties in input order, so the plan is deterministic. A sample longer than the budget
    runs alone.
    """
    if max_tokens < 1:
        raise GymvError(f"micro_batch_tokens must be >= 1, got {max_tokens}", where="training.micro_batch_tokens",
                        fix="set training.micro_batch_tokens to a positive token count")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        if current and (len(current) + 1) * longest > max_tokens:
            plan.append(current)
            current = []
        if not current:
            longest = lengths[i]
        current.append(i)
    if current:
        plan.append(current)
    return plan


def plan_packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Index lists whose summed length stays <= max_tokens: each micro-batch runs as one packed row, so it
    costs its real tokens only. First fit, longest first (ties in input order), so the plan is deterministic
    and close to the fewest rows; a sample longer than the budget runs alone. Indices within a list ascend.
    """
    if max_tokens < 1:
        raise GymvError(f"micro_batch_tokens must be >= 1, got {max_tokens}", where="training.micro_batch_tokens",
                        fix="set training.micro_batch_tokens to a positive token count")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def plan_packed_shared_micro_batches(prefixes: Sequence[tuple | None], lengths: Sequence[int],
                                     max_tokens: int) -> list[list[int]]:
    """Index lists for packed rows in which the samples of a group run their shared prefix once: a micro-batch
    costs each distinct prefix once plus every sample's remainder (`prefixes[i]` is (length, key...) or None:
    the whole sample), at most max_tokens. A group stays in one row where it fits (else it is cut into as few
    pieces as fit, each with its prefix); groups and unshared samples are then placed first fit, costliest
    first (ties in input order), so the plan is deterministic. Indices within a list ascend."""
    if max_tokens < 1:
        raise GymvError(f"micro_batch_tokens must be >= 1, got {max_tokens}", where="training.micro_batch_tokens",
                        fix="set training.micro_batch_tokens to a positive token count")
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prefixes):
        if p is not None:
            groups.setdefault(p, []).append(i)
    items: list[tuple[int, list[int]]] = []  # (cost, indices)
    grouped: set[int] = set()
    for key, members in groups.items():
        if len(members) == 1:
            continue
        grouped.update(members)
        piece: list[int] = []
        cost = key[0]
        for i in sorted(members, key=lambda i: (-(lengths[i] - key[0]), i)):
            rest = lengths[i] - key[0]
            if piece and cost + rest > max_tokens:
                items.append((cost, piece))
                piece, cost = [], key[0]
            piece.append(i)
            cost += rest
        items.append((cost, piece))
    items += [(lengths[i], [i]) for i in range(len(lengths)) if i not in grouped]
    items.sort(key=lambda item: (-item[0], min(item[1])))
    bins: list[list[int]] = []
    room: list[int] = []
    for cost, members in items:
        for b, free in enumerate(room):
            if cost <= free:
                bins[b] += members
                room[b] -= cost
                break
        else:
            bins.append(list(members))
            room.append(max_tokens - cost)
    return [sorted(b) for b in bins]


def shared_prefix_cost(plan: Sequence[Sequence[int]], prefixes: Sequence[tuple | None], lengths: Sequence[int]) -> int:
    """Tokens a shared-prefix plan computes: per micro-batch, distinct prefixes x longest prefix + samples x
    longest remainder (prefix None: the whole padded row)."""
    total = 0
    for mb in plan:
        if any(prefixes[i] is None for i in mb):
            total += len(mb) * max(lengths[i] for i in mb)
            continue
        keys = {prefixes[i] for i in mb}
        total += len(keys) * max(k[0] for k in keys) + len(mb) * max(lengths[i] - prefixes[i][0] for i in mb)
    return total


def plan_shared_prefix_micro_batches(prefixes: Sequence[tuple | None], lengths: Sequence[int],
                                     max_tokens: int) -> list[list[int]]:
    """Index lists for a forward pass that runs each distinct prefix once and every sample's remainder on
    top of it (gymv.backends.logprobs): a micro-batch costs distinct prefixes x longest prefix + samples x
    longest remainder, at most max_tokens. `prefixes[i]` is (length, key...) or None; the samples of one
    prefix stay together (longest remainder first), prefixes in order of first appearance, so the plan is
    deterministic. Any None: the plain padded plan of :func:`plan_micro_batches`.
    """
    if any(p is None for p in prefixes) or max_tokens < 1:
        return plan_micro_batches(lengths, max_tokens)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prefixes):
        groups.setdefault(p, []).append(i)
    plan: list[list[int]] = []
    current: list[int] = []
    keys: set = set()
    longest_prefix = longest_rest = 0
    for key, members in groups.items():
        prefix = key[0]
        for i in sorted(members, key=lambda i: (-(lengths[i] - prefix), i)):
            rest = lengths[i] - prefix
            new_keys = len(keys) + (key not in keys)
            cost = new_keys * max(longest_prefix, prefix) + (len(current) + 1) * max(longest_rest, rest)
            if current and cost > max_tokens:
                plan.append(current)
                current, keys, longest_prefix, longest_rest = [], set(), 0, 0
            current.append(i)
            keys.add(key)
            longest_prefix, longest_rest = max(longest_prefix, prefix), max(longest_rest, rest)
    if current:
        plan.append(current)
    return plan


def pad_collate(samples: Sequence[Mapping[str, Tensor]], pad_values: Mapping[str, float | int | bool] | None = None) -> dict[str, Tensor]:
    """Stack samples key by key: 1-D+ tensors are right-padded along dim 0, 0-d tensors are stacked.

    Every sample must have the same keys. Padding values: `pad_values[key]`, else DEFAULT_PAD_VALUES, else 0.
    Adds `attention_mask` [B,T] (1 on real positions) unless the samples carry one.
    """
    if not samples:
        raise RuntimeError("cannot collate an empty micro-batch")
    keys = list(samples[0].keys())
    for n, s in enumerate(samples):
        if set(s.keys()) != set(keys):
            raise RuntimeError(f"collate: sample {n} has keys {sorted(s)} but sample 0 has {sorted(keys)}")
    pads = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
    out: dict[str, Tensor] = {}
    for key in keys:
        values = [s[key] for s in samples]
        if values[0].dim() == 0:
            out[key] = torch.stack(values)
            continue
        longest = max(v.shape[0] for v in values)
        shape = (len(values), longest, *values[0].shape[1:])
        batch = torch.full(shape, pads.get(key, 0), dtype=values[0].dtype, device=values[0].device)
        for row, v in enumerate(values):
            if v.shape[1:] != values[0].shape[1:]:
                raise RuntimeError(f"collate: field {key!r} has trailing shape {tuple(v.shape[1:])} in one sample and "
                                   f"{tuple(values[0].shape[1:])} in another")
            batch[row, : v.shape[0]] = v
        out[key] = batch
    if "attention_mask" not in out and "input_ids" in out:
        lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], device=out["input_ids"].device)
        out["attention_mask"] = (torch.arange(out["input_ids"].shape[1], device=lengths.device)[None, :] < lengths[:, None]).long()
    return out
