"""Mixed precision for a VLM's vision tower and projector (the modules FSDP2 keeps replicated).

FSDP2's mixed-precision policy casts only its units' weights, and the trainer drops its own autocast under it:
left alone, the replicated tower ran every matrix product in float32 (a fifth of a Qwen2.5-VL-7B step on an
H200, SIMT kernels). The torch backend runs the whole model under autocast. In both, the tower's master
weights stay float32, and it computes in the trainer's dtype two ways:

- outside a training step (logprobs, a reference pass) under autocast, as before;
- inside one, from a working copy: every weight cast once, in one multi-tensor copy, for the whole step
  (each micro-batch, activation checkpointing's recomputation and the backward pass read the same copy),
  with autocast off and the inputs cast on the way in, as FSDP2 runs its units. Why: autocast casts a
  weight at each use and the activations at each matrix product (RADIO-H: a third of the tower's ~4,800
  kernels a call were casts, its host time the bound), and the cast's backward ran once per use. The copy's
  backward hands the step's summed gradient to the float32 master in one multi-tensor copy as well.
  The residual stream then runs in the compute dtype, as in the FSDP2 units.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_map


class _CastAll(torch.autograd.Function):
    """Every weight to `dtype` in one multi-tensor copy; backward: every gradient onto its master's `.grad`, in
    the master's dtype, by one multi-tensor copy (a master without one yet) or add (one that has one: a later
    micro-batch). Handing autograd float32 gradients instead would convert each into a new tensor and then
    add that to `.grad`: 18 bytes a weight moved where the add in place moves 10."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: torch.Tensor):
        ctx.masters = weights  # not saved tensors: every micro-batch's backward pass runs this node again
        ctx.set_materialize_grads(False)  # a weight no pass used keeps no gradient, as before
        out = [torch.empty_like(w, dtype=dtype) for w in weights]
        torch._foreach_copy_(out, list(weights))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(p, g) for p, g in zip(ctx.masters, grads) if g is not None]
        fresh = [(p, g) for p, g in pairs if p.grad is None]
        summed = [(p, g) for p, g in pairs if p.grad is not None]
        if fresh:
            made = [torch.empty_like(p) for p, _ in fresh]  # the master's strides: CUDA's fused AdamW asks them
            torch._foreach_copy_(made, [g for _, g in fresh])
            for (p, _), m in zip(fresh, made):
                p.grad = m
        if summed:
            torch._foreach_add_([p.grad for p, _ in summed], [g for _, g in summed])
        return (None,) * (len(grads) + 1)


# module names (path components) of the vision side of a VLM: kept replicated under FSDP2
VISION_MODULES = frozenset({"vision_tower", "visual", "vision_model", "multi_modal_projector", "mm_projector"})


def is_vision(name: str) -> bool:
    return any(part in VISION_MODULES for part in name.split("."))


def autocast_replicated(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> ReplicatedPrecision:
    """The vision modules of `model` computing in `dtype`: under autocast outside a training step, from a working
    copy cast once inside one (`ReplicatedPrecision.working_copy`). Their master weights stay float32. A model
    set up before (a second trainer on it) keeps its first setup."""
    found = getattr(model, "_gymv_precision", None)
    if found is not None and (found.device_type, found.dtype) == (device_type, dtype):
        return found
    names: list[str] = []
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULES and not any(name.startswith(w + ".") for w in names):
            names.append(name)
    model._gymv_precision = ReplicatedPrecision(model, names, device_type, dtype)
    return model._gymv_precision


class ReplicatedPrecision:
    """The replicated modules of `model` (top-level names in `names`) computing in `dtype` (module docstring)."""

    def __init__(self, model: torch.nn.Module, names: list[str], device_type: str, dtype: torch.dtype):
        self.names, self.device_type, self.dtype = names, device_type, dtype
        modules = [model.get_submodule(n) for n in names]
        self.slots = [(m, k) for top in modules for m in top.modules() for k, p in m._parameters.items() if p is not None]
        self.active = False
        for top in modules:
            top.forward = self._wrap(top.forward)

    def _wrap(self, forward):
        def run(*args, **kwargs):
            if self.active:
                cast = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
                with torch.autocast(self.device_type, enabled=False):
                    return forward(*tree_map(cast, args), **tree_map(cast, kwargs))
            with torch.autocast(self.device_type, dtype=self.dtype):
                return forward(*args, **kwargs)
        return run

    @contextlib.contextmanager
    def working_copy(self) -> Iterator[None]:
        """The modules read one cast copy of their weights until the block ends (a training step's passes)."""
        with cast_copies([self.slots], self.dtype):
            self.active = True
            try:
                yield
            finally:
                self.active = False


Slot = tuple[torch.nn.Module, str]  # a module and the name of one of its parameters


@contextlib.contextmanager
def cast_copies(groups: list[list[Slot]], dtype: torch.dtype) -> Iterator[None]:
    """Each group's parameters replaced by one `dtype` copy until the block ends, made by one multi-tensor copy a
    group (`_CastAll`), whose backward hands the group's gradients to the masters once all of the group's uses
    in a backward pass are done: a group a decoder layer, the layer's float32 gradients exist one layer at a
    time. A parameter frozen (or grad mode off) is copied without a gradient path. The masters are back in
    place after the block, also when it raises."""
    saved: list[tuple[list[Slot], list[torch.nn.Parameter]]] = []
    try:
        for slots in groups:
            masters = [m._parameters[k] for m, k in slots]
            saved.append((slots, masters))
            unique = list({id(p): p for p in masters}.values())
            trainable = [p for p in unique if p.requires_grad and torch.is_grad_enabled()]
            frozen = [p for p in unique if not (p.requires_grad and torch.is_grad_enabled())]
            copies = dict(zip(map(id, trainable), _CastAll.apply(dtype, *trainable))) if trainable else {}
            if frozen:
                with torch.no_grad():
                    held = [torch.empty_like(p, dtype=dtype) for p in frozen]
                    torch._foreach_copy_(held, frozen)
                copies.update(zip(map(id, frozen), held))
            for (m, k), p in zip(slots, masters):
                m._parameters[k] = copies[id(p)]
        yield
    finally:
        for slots, masters in saved:
            for (m, k), p in zip(slots, masters):
                m._parameters[k] = p
