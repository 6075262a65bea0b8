"""A model's decoder layers: the units FSDP2 shards, the layers `training.compile` compiles and the groups of
the torch backend's working copy (gymv.backends.training.step_copy)."""

from __future__ import annotations

import torch

from gymv.backends.training.replicated_precision import is_vision


def decoder_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """HF's no-split blocks (decoder layers) of the language side, else the members of every ModuleList (plain
    torch models)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names and not is_vision(n)]
    if units:
        return units
    return [(f"{n}.{i}", m) for n, lst in model.named_modules() if isinstance(lst, torch.nn.ModuleList) and not is_vision(n)
            for i, m in enumerate(lst)]
