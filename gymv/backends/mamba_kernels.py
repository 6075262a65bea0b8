"""`mamba_ssm`'s Triton kernels for Mamba-2, reached without running the package's `__init__`.

The chunked SSD scan (`mamba_chunk_scan_combined`, which takes a packed row's `seq_idx`) and the one-token
state update (`selective_state_update`) are Triton kernels: they need no compiled extension. The PyPI
release of `mamba_ssm` installs without building its CUDA extension (`MAMBA_SKIP_CUDA_BUILD=TRUE
MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation`, see the `kernels` extra), but its package
`__init__` imports the Mamba-1 modules, which import that missing extension, so `import mamba_ssm` fails.
`load` imports the Triton modules under their own names with the package's `__init__` skipped (empty
package modules standing in for `mamba_ssm`, `mamba_ssm.ops` and `mamba_ssm.ops.triton` while they import),
then takes the stand-ins out of `sys.modules` again, so that nothing else (transformers' own kernel lookup
included) sees a half-imported `mamba_ssm`. The causal convolution (`causal_conv`) comes from `causal_conv1d`
when it imports (a compiled extension of its own), else from gymv's Triton kernel with segment masking
(gymv.backends.conv_kernel); gymv's torch convolution (ssd_scan.segment_conv1d) runs where there are no kernels.

The kernels run on CUDA only; `load` returns None with the reason in `why_not` anywhere else.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from gymv.backends.ssd_scan import segment_conv1d

log = logging.getLogger(__name__)

PACKAGE = "mamba_ssm"
SCAN_MODULE = "mamba_ssm.ops.triton.ssd_combined"
UPDATE_MODULE = "mamba_ssm.ops.triton.selective_state_update"
SWITCH = "GYMV_MAMBA_KERNELS"
INSTALL = ("MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation 'gymv[kernels]'")


@dataclass(frozen=True)
class Kernels:
    """The CUDA kernels of a Mamba-2 mixer; `conv` is None where `causal_conv1d` is not installed (then
    `segment_conv`, gymv's Triton convolution, runs it: see `causal_conv`)."""

    chunk_scan: Callable  # mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=, dt_bias=, seq_idx=, ...)
    state_update: Callable  # selective_state_update(state, x, dt, A, B, C, D=, dt_bias=, dt_softplus=)
    conv: Callable | None  # causal_conv1d_fn(x [B, C, L], weight [C, K], bias, seq_idx=, activation=)
    # rmsnorm_fn(x, weight, bias, z=, eps=, group_size=, norm_before_gate=): the gated norm in one kernel each way
    gated_norm: Callable | None = None
    # segment_conv1d_triton(x [B, L, C], weight [C, K], bias, seq_idx, activation=): ssd_scan.segment_conv1d's
    # contract in one Triton kernel each way
    segment_conv: Callable | None = None


def _stand_ins(spec) -> dict[str, types.ModuleType]:
    """Empty package modules for mamba_ssm and its ops packages, with the real search paths."""
    made = {}
    root = list(spec.submodule_search_locations)
    for name, sub in ((PACKAGE, ()), (f"{PACKAGE}.ops", ("ops",)), (f"{PACKAGE}.ops.triton", ("ops", "triton")),
                      (f"{PACKAGE}.utils", ("utils",))):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(r, *sub) for r in root]
        mod.__package__ = name
        made[name] = mod
    return made


def _import_triton_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """(ssd_combined, selective_state_update) modules, the package `__init__` skipped (module docstring)."""
    if PACKAGE in sys.modules and not getattr(sys.modules[PACKAGE], "__gymv_stand_in__", False):
        # a full install already imported (with its extension): use it as it is
        return importlib.import_module(SCAN_MODULE), importlib.import_module(UPDATE_MODULE)
    spec = importlib.util.find_spec(PACKAGE)  # a top-level find_spec does not run the package
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{PACKAGE} is not installed")
    before = {k: v for k, v in sys.modules.items() if k == PACKAGE or k.startswith(PACKAGE + ".")}
    stand_ins = _stand_ins(spec)
    for mod in stand_ins.values():
        mod.__gymv_stand_in__ = True
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module(SCAN_MODULE), importlib.import_module(UPDATE_MODULE)
    finally:
        for k in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
            del sys.modules[k]
        sys.modules.update(before)


def _segment_conv() -> Callable | None:
    from gymv.backends import conv_kernel

    return conv_kernel.segment_conv1d_triton if conv_kernel.available() else None


def _conv() -> Callable | None:
    try:
        from causal_conv1d import causal_conv1d_fn  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - absent, or its extension does not load: the torch convolution
        return None
    return causal_conv1d_fn


@lru_cache(maxsize=None)
def _load() -> tuple[Kernels | None, str | None]:
    if not torch.cuda.is_available():
        return None, "no CUDA device (the Triton kernels run on CUDA only)"
    try:
        scan, update = _import_triton_modules()
    except Exception as e:  # noqa: BLE001 - any import failure means the torch path, with the reason
        return None, f"{PACKAGE}'s Triton kernels do not import ({type(e).__name__}: {e}); install: {INSTALL}"
    return Kernels(scan.mamba_chunk_scan_combined, update.selective_state_update, _conv(),
                   getattr(scan, "rmsnorm_fn", None), _segment_conv()), None


def load(device: torch.device | str | None = None) -> Kernels | None:
    """The Mamba-2 CUDA kernels for `device` (None: any CUDA device), or None (see `why_not`); the reason for
    None is logged once. `GYMV_MAMBA_KERNELS=0` in the environment turns them off (the torch path then runs
    everywhere, as benchmarks compare)."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if _off():
        return None
    kernels, reason = _load()
    if kernels is None:
        _log_once(reason)
    return kernels


def causal_conv(kernels: Kernels | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                seq_idx: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """A mixer's causal depthwise convolution of x [B, L, C] (weight [C, K], seq_idx [B, L]; the contract of
    ssd_scan.segment_conv1d) on the fastest path `kernels` has: causal_conv1d (which takes seq_idx in the
    channel-last layout only, its channel stride a multiple of 8), else gymv's Triton kernel, else (no kernels:
    CPU, or GYMV_MAMBA_KERNELS=0) the torch convolution."""
    if kernels is not None and kernels.conv is not None and x.shape[-1] % 8 == 0:
        return kernels.conv(x.contiguous().transpose(1, 2), weight, bias, seq_idx=seq_idx,
                            activation=activation).transpose(1, 2)
    if kernels is not None and kernels.segment_conv is not None:
        return kernels.segment_conv(x, weight, bias, seq_idx, activation=activation)
    return segment_conv1d(x, weight, bias, seq_idx, activation=activation)


def why_not(device: torch.device | str | None = None) -> str | None:
    """Why `load(device)` gives None, or None when the kernels are there."""
    if device is not None and torch.device(device).type != "cuda":
        return f"the inputs are on {torch.device(device).type}, the kernels run on CUDA only"
    if _off():
        return f"{SWITCH}=0 in the environment"
    return _load()[1]


def _off() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


@lru_cache(maxsize=None)
def _log_once(reason: str | None) -> None:
    log.warning("Mamba-2 layers run on gymv's torch scan, not mamba_ssm's Triton kernels: %s", reason)
