"""An AdamW step that a non-finite loss or gradient norm cancels on the device, so the host need not wait.

Reading a flag on the host before the step drains the GPU queue: the GPU then idles while the host launches
the clip and the step. AdamW's fused kernel instead takes a `found_inf` tensor (as torch's GradScaler
passes it): where it is 1 the kernel leaves weights, moments and (after adding and taking back one) the step
count as they were. The trainer queues norm, clip and step, and reads every flag once, afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer honours `found_inf`: AdamW's fused kernel (every group), or gymv's own."""
    if getattr(optimizer, "honours_found_inf", False):
        return True
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


def finite_or(norm: Tensor, value: float) -> Tensor:
    """`norm`, or `value` where it is inf/NaN: a clip by a non-finite norm must scale nothing (its step is
    cancelled, and its gradients are dropped unchanged)."""
    return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, value))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: Tensor) -> list[Tensor]:
    """Queue a fused AdamW step that does nothing where the 0-d float32 `found_inf` is 1; returns the
    parameters this step gave their first state, for `drop_fresh_state` should the step turn out cancelled."""
    state = optimizer.state
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = [p for p in params if p.grad is not None and not state.get(p)]
    if found_inf.device.type != "cpu" and any(p.device.type == "cpu" for p in params):
        found_inf = found_inf.cpu()  # offloaded shards step on the host, whose kernel reads the flag at once
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
    return fresh


def drop_fresh_state(optimizer: torch.optim.Optimizer, fresh: list[Tensor]) -> None:
    """Undo the state a cancelled step created (zero moments, step 0), so the optimizer's state dict is the
    one before the step, as if it had never been called."""
    for p in fresh:
        optimizer.state.pop(p, None)
