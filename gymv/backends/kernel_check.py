"""A Triton kernel's one-time check on a device before gymv uses it there, and its switch.

A kernel that fails to compile on a card, or computes something else than the torch code it replaces,
must not fail or bend a training run: each kernel family runs a small comparison with its torch reference
once per device (no autograd, so that it may run inside a checkpointed forward), and the torch code stays in
use where that fails, with one warning. No check runs while a CUDA graph is being captured (the caller's
torch path runs then), and an environment switch turns a family off (benchmarks compare both paths).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_results: dict[tuple[str, str], bool] = {}


def switched_off(switch: str) -> bool:
    return os.environ.get(switch, "1").strip().lower() in ("0", "false", "no", "off")


def verified(name: str, switch: str, device: torch.device, check: Callable[[torch.device], bool]) -> bool:
    """Whether kernel family `name` runs on CUDA `device`: not switched off (`switch`=0), and `check(device)`
    (run once per device; an exception counts as a failure) returned True."""
    if device.type != "cuda" or switched_off(switch):
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, str(device))
    if key not in _results:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            with torch.no_grad():
                ok = bool(check(device))
            why = "it disagrees with the torch code it replaces"
        except Exception as e:  # noqa: BLE001 - any failure means the torch code, said once
            ok, why = False, f"{type(e).__name__}: {str(e)[:200]}"
        if not ok:
            log.warning("%s: gymv's Triton kernels do not run on %s (%s); the torch code runs instead", name,
                        device, why)
        _results[key] = ok
    return _results[key]
