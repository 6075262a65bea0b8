"""What `gymv train` can run with what is installed: the one table that says which config values are wired.

The schema accepts values for things that are planned but not built here (a vLLM generation backend, a
Megatron-core trainer...). A recipe that uses one must be refused before anything starts, by
`gymv train` (config loading), flagged by `gymv lint` when a nightly or release suite lists it, and named by
`gymv smoke --tiny` when its stand-ins replace it. All three read `gaps(cfg)`; wiring a feature means
registering its backend (gymv.backends.registry) or deleting its row in NOT_WIRED below, nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymv.backends.generation.vllm_models import MOE_ON_CPU, SWIGLU_RADIO, VISION_DTYPE
from gymv.backends.registry import GENERATION_BACKENDS, REFIT_TRANSPORTS, TEACHER_BACKENDS, TRAINING_BACKENDS

# key -> {value: why that value does not run}. A backend registered under the same name wins over its row.
NOT_WIRED: dict[str, dict[Any, str]] = {
    "mopd.teachers.*.backend": {
        "megatron": "Megatron-core teachers are not wired into gymv train yet",
    },
    "vision.dedup_payloads": {False: "the generation backend always encodes an image shared by a group once"},
}
FIXES: dict[str, str] = {
    "generation.backend": "use generation.backend: hf",
    "training.backend": "use training.backend: torch",
    "mopd.teachers.*.backend": "use backend: torch",
    "vision.dedup_payloads": "remove vision.dedup_payloads (it is always on)",
}
# model type (config.json) -> {(key, value): why a model of that family cannot run there}; checked by
# `gymv train` once model.path is resolved, before Ray starts (`family_gaps`)
FAMILY_LIMITS: dict[str, dict[tuple[str, Any], str]] = {
    "nemotron_h_omni": {
        ("training.backend", "megatron"): (
            "Nemotron 3 Omni's Mamba-2 and MoE layers have no Megatron twin in gymv: megatron-core 0.16.1's hybrid "
            "MambaModel builds its layers from Transformer Engine modules and runs the CUDA kernels of the "
            "mamba-ssm and causal-conv1d packages (compiled against the CUDA toolkit; no CPU path), none of which "
            "gymv installs"),
    },
}
FAMILY_FIXES: dict[str, str] = {
    "training.backend": "use training.backend: torch or fsdp2",
}
# model type -> {where: why vLLM cannot run a model of that family there}; these depend on the device, the
# dtype and the layers, so `gymv train` checks them against each vLLM engine's checkpoint before Ray starts
# (gymv.backends.generation.vllm_models.refusal, which words the same reasons)
VLLM_FAMILY_LIMITS: dict[str, dict[str, str]] = {
    "nemotron_h": {"on CPU, with mixture-of-experts layers": MOE_ON_CPU},
    "nemotron_h_omni": {"on CPU, with mixture-of-experts layers": MOE_ON_CPU,
                        "in float32 or float16": VISION_DTYPE.format(dtype="float32 or float16"),
                        "with a SwiGLU RADIO tower": SWIGLU_RADIO},
}
# what the project's own generation backends can span: GPUs per engine
MAX_GENERATION_TP: dict[str, int] = {"hf": 1}


@dataclass(frozen=True)
class Gap:
    """One thing a recipe asks for that this installation cannot run."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def backend_names(key: str) -> list[str]:
    """Every value the schema accepts for a backend key: registered backends and planned ones."""
    registry = {"generation.backend": GENERATION_BACKENDS, "training.backend": TRAINING_BACKENDS}[key]
    return sorted({*registry.available(), *NOT_WIRED.get(key, {})})


def _registered(key: str, name: str) -> bool:
    registry = {"generation.backend": GENERATION_BACKENDS, "training.backend": TRAINING_BACKENDS}[key]
    return name in registry


def _not_wired(key: str, value: Any, table_key: str | None = None) -> Gap | None:
    row = table_key or key
    reason = NOT_WIRED.get(row, {}).get(value)
    return Gap(key, reason, FIXES.get(row, f"change {key}")) if reason else None


def gaps(cfg) -> list[Gap]:
    """What in a validated recipe this installation cannot run (empty: `gymv train` can run it)."""
    return list(_gaps(cfg))


def _gaps(cfg) -> Iterator[Gap]:
    for key in ("generation.backend", "training.backend"):
        section, _, field = key.partition(".")
        name = getattr(getattr(cfg, section), field)
        if not _registered(key, name):
            yield _not_wired(key, name) or Gap(key, f"no {section} backend {name!r} is installed",
                                               f"use one of: {', '.join(backend_names(key))}")
    if cfg.training.backend == "megatron":
        p = cfg.training.parallel
        for size in ("pipeline", "context", "expert"):
            if getattr(p, size) > 1:
                yield Gap(f"training.parallel.{size}",
                          f"training.backend megatron trains with training.parallel.{size} 1 here (only tensor "
                          "parallelism is wired)", f"set training.parallel.{size} to 1")
                break
    g = cfg.generation
    if g.backend != "vllm" and g.vllm != type(g.vllm)():
        yield Gap("generation.vllm", f"generation.vllm is read only by generation.backend vllm, this recipe uses {g.backend}",
                  "remove generation.vllm, or use generation.backend: vllm")
    tp = g.vllm.tensor_parallel_size if g.backend == "vllm" else 1
    if tp > MAX_GENERATION_TP.get(g.backend, tp):
        yield Gap("generation.vllm.tensor_parallel_size", f"generation backend {g.backend} runs an engine on one GPU",
                  "set the tensor parallel size to 1")

    mopd = getattr(cfg, "mopd", None)
    for alias, t in (mopd.teachers.items() if mopd is not None else ()):
        key = f"mopd.teachers.{alias}.backend"
        if t.backend not in TEACHER_BACKENDS:
            yield _not_wired(key, t.backend, "mopd.teachers.*.backend") or Gap(
                key, f"no teacher backend {t.backend!r} is installed", "use backend: torch")
    vision = getattr(cfg, "vision", None)
    if vision is not None:
        gap = _not_wired("vision.dedup_payloads", vision.dedup_payloads)
        if gap:
            yield gap


def model_type(model_dir: str | Path) -> str | None:
    """The `model_type` of a checkpoint folder's config.json (None where it has none or cannot be read)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def family_gaps(cfg, model_dir: str | Path) -> list[Gap]:
    """What a validated recipe asks of its model's family that the family cannot do (FAMILY_LIMITS)."""
    limits = FAMILY_LIMITS.get(model_type(model_dir) or "", {})
    out = []
    for (key, value), why in limits.items():
        section, _, field = key.partition(".")
        if getattr(getattr(cfg, section), field) == value and type(getattr(getattr(cfg, section), field)) is type(value):
            out.append(Gap(key, f"{key} {str(value).lower() if isinstance(value, bool) else value}: {why}",
                           FAMILY_FIXES[key]))
    return out


def table() -> dict[str, dict[str, str]]:
    """The capability table for people (docs, `gymv train --help` texts): key -> {value: 'runs' or why not}."""
    out: dict[str, dict[str, str]] = {
        "generation.backend": {n: "runs" for n in GENERATION_BACKENDS.available()},
        "training.backend": {n: "runs" for n in TRAINING_BACKENDS.available()},
        "mopd.teachers.*.backend": {n: "runs" for n in TEACHER_BACKENDS.available()},
        "refit.transport": {**{n: "runs" for n in REFIT_TRANSPORTS.available()}, "auto": "runs"},
    }
    # loggers (gymv.loggers) are wired; each needs its optional library, checked by `gymv train` before it starts
    out["logger.tensorboard"] = {"true": "runs (needs the tensorboard package)"}
    out["logger.wandb"] = {"true": "runs (needs the wandb package)"}
    for key, row in NOT_WIRED.items():
        for value, why in row.items():
            out.setdefault(key, {}).setdefault(str(value).lower() if isinstance(value, bool) else str(value), why)
    for family, limits in FAMILY_LIMITS.items():
        for (key, value), why in limits.items():
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            out.setdefault(f"{key} [{family}]", {})[shown] = why
    for family, rows in VLLM_FAMILY_LIMITS.items():
        for key in ("generation.backend", "mopd.teachers.*.backend"):
            for where, why in rows.items():
                out.setdefault(f"{key} [{family}]", {})[f"vllm {where}"] = why
    return out
