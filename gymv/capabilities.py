"""What `gymv train` can run with what is installed: the one reader of what the registries' entries declare.

Each backend's registry entry (gymv.backends.registry) declares what it can do: the optional package it needs
and how to install it, the model parallelism it runs, the model families it cannot run. The schema also
accepts a few values nothing implements yet, listed in NOT_WIRED below. A recipe
that asks for what cannot run is refused before anything starts by `gymv train` (config loading), flagged by
`gymv lint` when a nightly or release suite lists it, and named by `gymv smoke --tiny` when its stand-ins
replace it. All three read `gaps(cfg)`; `gymv train` adds `missing_packages(cfg)` and `family_gaps(cfg, ...)`
(what this Python lacks, what the checkpoint's family cannot do). Wiring a feature means registering its
backend with its capabilities, or deleting its row in NOT_WIRED, nothing else.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymv.backends.generation.vllm_models import MOE_ON_CPU, SWIGLU_RADIO, VISION_DTYPE
from gymv.backends.registry import GENERATION_BACKENDS, REFIT_TRANSPORTS, TEACHER_BACKENDS, TRAINING_BACKENDS
from gymv.registry import Registry

# key -> {value: why that value does not run}. A backend registered under the same name wins over its row.
NOT_WIRED: dict[str, dict[Any, str]] = {
    "vision.dedup_payloads": {False: "the generation backend always encodes an image shared by a group once"},
}
FIXES: dict[str, str] = {
    "generation.backend": "use generation.backend: hf",
    "training.backend": "use training.backend: torch",
    "mopd.teachers.*.backend": "use backend: torch",
    "vision.dedup_payloads": "remove vision.dedup_payloads (it is always on)",
}
BACKEND_KEYS: dict[str, Registry] = {"generation.backend": GENERATION_BACKENDS, "training.backend": TRAINING_BACKENDS}
TEACHER_KEY = "mopd.teachers.*.backend"
# model type -> {where: why vLLM cannot run a model of that family there}; these depend on the device, the
# dtype and the layers, so `gymv train` checks them against each vLLM engine's checkpoint before Ray starts
# (gymv.backends.generation.vllm_models.refusal, which words the same reasons)
VLLM_FAMILY_LIMITS: dict[str, dict[str, str]] = {
    "nemotron_h": {"on CPU, with mixture-of-experts layers": MOE_ON_CPU},
    "nemotron_h_omni": {"on CPU, with mixture-of-experts layers": MOE_ON_CPU,
                        "in float32 or float16": VISION_DTYPE.format(dtype="float32 or float16"),
                        "with a SwiGLU RADIO tower": SWIGLU_RADIO},
}


@dataclass(frozen=True)
class Gap:
    """One thing a recipe asks for that this installation cannot run."""

    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def backend_registry(key: str) -> Registry:
    """The registry of a backend key (generation.backend, training.backend, mopd.teachers.*.backend)."""
    return TEACHER_BACKENDS if key == TEACHER_KEY else BACKEND_KEYS[key]


def backend_names(key: str) -> list[str]:
    """Every value the schema accepts for a backend key: registered backends, and those NOT_WIRED names (refused
    with the reason)."""
    return sorted({*backend_registry(key).available(), *NOT_WIRED.get(key, {})})


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
        if name not in BACKEND_KEYS[key]:
            yield _not_wired(key, name) or Gap(key, f"no {section} backend {name!r} is installed",
                                               f"use one of: {', '.join(backend_names(key))}")
    training = cfg.training
    wired = TRAINING_BACKENDS.capabilities(training.backend).model_parallel
    for size in ("tensor", "pipeline", "context", "expert"):
        if wired and size not in wired and getattr(training.parallel, size) > 1:  # none wired: lint's parallel.backend
            yield Gap(f"training.parallel.{size}",
                      f"training.backend {training.backend} trains with training.parallel.{size} 1 here (only "
                      f"{' and '.join(wired)} parallelism is wired)", f"set training.parallel.{size} to 1")
    g = cfg.generation
    if not GENERATION_BACKENDS.capabilities(g.backend).reads_vllm_section and g.vllm != type(g.vllm)():
        readers = " or ".join(GENERATION_BACKENDS.having(lambda c: c.reads_vllm_section))
        yield Gap("generation.vllm", f"generation.vllm is read only by generation.backend {readers}, this recipe uses "
                  f"{g.backend}", f"remove generation.vllm, or use generation.backend: {readers}")

    mopd = getattr(cfg, "mopd", None)
    for alias, t in (mopd.teachers.items() if mopd is not None else ()):
        key = f"mopd.teachers.{alias}.backend"
        if t.backend not in TEACHER_BACKENDS:
            yield _not_wired(key, t.backend, TEACHER_KEY) or Gap(
                key, f"no teacher backend {t.backend!r} is installed", "use backend: torch")
            continue
        caps = TEACHER_BACKENDS.capabilities(t.backend)  # one that spans no GPUs: lint's teacher.parallel
        for size, kind in (("tensor_parallel_size", "tensor"), ("expert_parallel_size", "expert")):
            if caps.spans_gpus and getattr(t, size) > 1 and kind not in caps.model_parallel:
                able = " or ".join(TEACHER_BACKENDS.having(lambda c, k=kind: k in c.model_parallel))
                yield Gap(f"mopd.teachers.{alias}.{size}", f"teacher backend {t.backend} scores with {size} 1 here "
                          f"({kind} parallelism is not wired for it)", f"set {size}: 1, or use backend: {able}")
        if t.engine_kwargs and not TEACHER_BACKENDS.capabilities(t.backend).reads_engine_kwargs:
            readers = " or ".join(TEACHER_BACKENDS.having(lambda c: c.reads_engine_kwargs))
            yield Gap(f"mopd.teachers.{alias}.engine_kwargs", f"engine_kwargs is read only by teacher backend "
                      f"{readers}, teacher {alias!r} uses {t.backend}", f"remove it, or use backend: {readers}")
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
    """The recipe's backends that declare they cannot run its model's family (`refused_families`)."""
    family = model_type(model_dir)
    out = []
    for key, registry in BACKEND_KEYS.items():
        section, _, field = key.partition(".")
        name = getattr(getattr(cfg, section), field)
        why = registry.capabilities(name).refused_families.get(family) if family else None
        if why:
            able = " or ".join(registry.having(lambda c: family not in c.refused_families))
            out.append(Gap(key, f"{key} {name}: {why}", f"use {key}: {able}"))
    return out


def missing_packages(cfg) -> list[Gap]:
    """The recipe's backends whose declared package this Python lacks, each with the fix its entry declares."""
    mopd = getattr(cfg, "mopd", None)
    asked = [(key, registry, getattr(cfg, key.split(".")[0]).backend) for key, registry in BACKEND_KEYS.items()]
    asked += [(f"mopd.teachers.{alias}.backend", TEACHER_BACKENDS, t.backend)
              for alias, t in (mopd.teachers.items() if mopd is not None else ())]
    out = []
    for key, registry, name in asked:
        need = registry.capabilities(name).needs
        if need is not None and not need.installed():
            out.append(Gap(key, f"{key} {name} needs the {need.name} package, which this Python ({sys.prefix}) lacks",
                           need.fix))
    return out


def table() -> dict[str, dict[str, str]]:
    """The capability table for people (docs, `gymv train --help` texts): key -> {value: 'runs' or why not}."""
    out: dict[str, dict[str, str]] = {
        "generation.backend": {n: "runs" for n in GENERATION_BACKENDS.available()},
        "training.backend": {n: "runs" for n in TRAINING_BACKENDS.available()},
        TEACHER_KEY: {n: "runs" for n in TEACHER_BACKENDS.available()},
        "refit.transport": {**{n: "runs" for n in REFIT_TRANSPORTS.available()}, "auto": "runs"},
    }
    # loggers (gymv.loggers) are wired; each needs its optional library, checked by `gymv train` before it starts
    out["logger.tensorboard"] = {"true": "runs (needs the tensorboard package)"}
    out["logger.wandb"] = {"true": "runs (needs the wandb package)"}
    for key, row in NOT_WIRED.items():
        for value, why in row.items():
            out.setdefault(key, {}).setdefault(str(value).lower() if isinstance(value, bool) else str(value), why)
    for key, registry in BACKEND_KEYS.items():
        for name, caps in registry.declared().items():
            for family, why in caps.refused_families.items():
                out.setdefault(f"{key} [{family}]", {})[name] = why
    for family, rows in VLLM_FAMILY_LIMITS.items():
        for key in ("generation.backend", "mopd.teachers.*.backend"):
            for where, why in rows.items():
                out.setdefault(f"{key} [{family}]", {})[f"vllm {where}"] = why
    return out
