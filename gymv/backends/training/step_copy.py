"""The language model's matrix weights cast once a training step, on one rank (`training.weight_copy`).

The torch backend trains float32 master weights under bfloat16 autocast, which casts a weight at each use: in
every micro-batch's forward, again in activation checkpointing's recomputation, and each cast's backward
converts that use's gradient and adds it to the master's. For a model of N weights and m micro-batches that is
about 26·N·m bytes moved in casts and as many small kernels as there are weights times uses. Here, for the
length of a step, each decoder layer's matrices (linear layers, the routed experts' stacked tensors) read one
bfloat16 copy made by one multi-tensor copy a layer (replicated_precision.cast_copies), and each layer's
gradient lands on its masters' `.grad` in one multi-tensor copy (the first micro-batch) or add in place (the
next ones) per backward pass: about 6·N bytes once plus 6 to 10·N a micro-batch, at the price of 2·N bytes
held for the step. Autocast stays on around the copy, so what it
computes is unchanged: the same bfloat16 products, the same float32 norms, embeddings and routers (whose
weights are not matrices of a linear layer and stay the masters); only the cast moves. Outside a step
(logprobs, a reference pass) nothing is copied.

The vision tower has its own copy (replicated_precision.ReplicatedPrecision); FSDP2 casts its units itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gymv.backends.moe_experts import EXPERTS
from gymv.backends.training.replicated_precision import Slot, cast_copies, is_vision
from gymv.backends.training.units import decoder_units


def _matrix_names(module: torch.nn.Module) -> tuple[str, ...]:
    if isinstance(module, torch.nn.Linear):
        return ("weight", "bias")
    if type(module).__name__ in EXPERTS:
        return ("up_proj", "down_proj")
    return ()


def matrix_groups(model: torch.nn.Module) -> list[list[Slot]]:
    """The language side's matrix parameters, one group a decoder layer and one for the rest (the head). A
    parameter another kind of module also holds (an input embedding tied to the head) is left out: its other
    use would read the copy."""
    other = {id(p) for m in model.modules() for k, p in m._parameters.items()
             if p is not None and k not in _matrix_names(m)}
    units = decoder_units(model)
    unit_of = {id(m): n for n, unit in units for m in unit.modules()}
    groups: dict[str, list[Slot]] = {n: [] for n, _ in units}
    groups[""] = []
    for name, module in model.named_modules():
        if is_vision(name):
            continue
        for k in _matrix_names(module):
            p = module._parameters.get(k)
            if p is not None and p.is_floating_point() and id(p) not in other:
                groups[unit_of.get(id(module), "")].append((module, k))
    return [g for g in groups.values() if g]


class StepCopy:
    """`model`'s matrices (matrix_groups) read from one `dtype` copy inside `working_copy()`."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        kept = ([(m, k) for m, k in group if m._parameters[k].dtype != dtype] for group in matrix_groups(model))
        self.groups = [g for g in kept if g]

    @contextlib.contextmanager
    def working_copy(self) -> Iterator[None]:
        with cast_copies(self.groups, self.dtype):
            yield
