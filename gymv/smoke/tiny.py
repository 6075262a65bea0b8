"""`--tiny`: the same recipe on the embedded tiny model and a CPU, so a laptop validates a GPU recipe's plumbing.

The model becomes the tiny stand-in of its family (gymv.models.families: Qwen2.5-VL -> tiny-qwen2_5vl,
Qwen3 -> tiny-qwen3, Llama -> tiny-llama, ...), and every teacher the student's stand-in, since a teacher
must share the student's tokenizer. What stays is what a smoke run is meant to exercise: the algorithm, the
environment and its turns and tools, async generation and importance sampling, MOPD routing and teachers (their count, aliases and data-parallel
padding), validation, checkpointing and the checks. What changes is everything that needs the cluster:
model and teacher weights, GPUs, parallel sizes (those the kept backend runs on a CPU shrink to 2, the
layout's structure at tiny size; the rest become 1), Megatron where its twin does not map the stand-in (a
Megatron teacher stays where the Megatron trainer does), GPU-only refit transports, remote environments
and data files, and the sizes (sequence length, batch, data) shrink to seconds of CPU work. vLLM (generation
and teachers) stays where it imports in the running interpreter and its CPU build runs the stand-in, and
becomes hf/torch elsewhere (and for Nemotron 3 Omni, whose mixture-of-experts layers vLLM's CPU build cannot
run).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from gymv.backends.registry import GENERATION_BACKENDS, REFIT_TRANSPORTS, TEACHER_BACKENDS, TRAINING_BACKENDS
from gymv.config.schema import PlacementSection, VllmSection
from gymv.envs import get_env
from gymv.models.families import tiny_stand_in
from gymv.models.tiny_build import TinyKnobs

TINY_MODEL = "embedded:tiny-llava"  # the stand-in of a VLM recipe whose model family gymv has no tiny twin of
MAX_SEQ_LEN = 512
MAX_NEW_TOKENS = 16
MAX_PROMPTS = 2
MAX_GENERATIONS = 4
MAX_BATCH = 4
MAX_VAL_PROMPTS = 4
N_TRAIN = 8
N_EVAL = 4
MAX_TEACHER_REPLICAS = 2
# a model-parallel size the kept backend runs on a CPU shrinks to this (the layout's structure at tiny size:
# TP8 x CP2 becomes TP2 x CP2 over 4 gloo ranks); one it does not run becomes 1
MAX_PARALLEL = 2
PARALLEL_SIZES = ("tensor", "pipeline", "context", "expert")


def _set(changes: list[str], d: dict, path: str, value: Any) -> None:
    """Set a dotted key, recording `key: old -> new` when it changes."""
    keys = path.split(".")
    node = d
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    old = node.get(keys[-1], None)
    if old != value:
        changes.append(f"{path}: {old!r} -> {value!r}")
    node[keys[-1]] = value


def _cap(changes: list[str], d: dict, path: str, cap: int) -> None:
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return
    v = node.get(keys[-1]) if isinstance(node, dict) else None
    if isinstance(v, int) and not isinstance(v, bool) and v > cap:
        _set(changes, d, path, cap)


def _tiny_preset(env_name: str) -> str | None:
    try:
        return "tiny" if "tiny" in getattr(get_env(env_name), "presets", {}) else None
    except Exception:  # an environment this machine cannot build keeps its own preset; the run will say why
        return None


def _gpu_transports() -> set[str]:
    return set(REFIT_TRANSPORTS.having(lambda c: c.needs_gpu))


def vllm_runs_here() -> bool:
    """vLLM imports in this interpreter (its own venv: scripts/install.sh vllm), so --tiny keeps it."""
    return GENERATION_BACKENDS.capabilities("vllm").needs.installed()


VLLM_CPU_REFUSED = {"tiny-nemotron-omni": "its mixture-of-experts layers"}
"""Tiny stand-ins vLLM's CPU build cannot run (gymv.capabilities.VLLM_FAMILY_LIMITS; a test checks this table
against the backend's own refusal): a --tiny run of such a recipe generates with hf (and scores with torch
teachers) instead."""


def vllm_runs_stand_in(tiny_model: str) -> bool:
    """vLLM imports here and its CPU build runs the tiny stand-in, so --tiny keeps the recipe's vllm backends."""
    return vllm_runs_here() and tiny_model.removeprefix("embedded:") not in VLLM_CPU_REFUSED


def megatron_runs_here() -> bool:
    """megatron-core imports in this interpreter (the dev extra installs it), so --tiny keeps that backend."""
    return TRAINING_BACKENDS.capabilities("megatron").needs.installed()


MEGATRON_STAND_INS = ("tiny-llava", "tiny-llava-next", "tiny-llava-onevision", "tiny-qwen2vl", "tiny-qwen2_5vl",
                      "tiny-smolvlm", "tiny-qwen3", "tiny-llama", "tiny-nemotron-omni")
"""The tiny models gymv's Megatron twin maps (a test checks this list against the backend's own check)."""


def _tiny_training_backend(backend: str | None, tiny_model: str) -> str:
    """The training backend a CPU smoke run uses: fsdp2 runs on one gloo rank, and megatron on a CPU where it
    is installed and maps the stand-in, so both keep their own code path; anything else runs as torch."""
    if backend == "fsdp2":
        return backend
    if backend == "megatron" and megatron_runs_here() and tiny_model.removeprefix("embedded:") in MEGATRON_STAND_INS:
        return backend
    return "torch"


def _tiny_size(size: int, runs: bool) -> int:
    """A parallel size at tiny size: at most MAX_PARALLEL where the kept backend runs it on a CPU, else 1."""
    return min(int(size), MAX_PARALLEL) if runs else 1


def _tiny_teacher_backend(backend: str | None, tiny_model: str, keep_vllm: bool) -> str:
    """A teacher keeps vllm where vLLM runs the stand-in, and megatron where the megatron training backend stays
    (the same twin scores); anything else scores with torch."""
    if backend == "vllm" and keep_vllm:
        return backend
    if backend == "megatron" and _tiny_training_backend(backend, tiny_model) == "megatron":
        return backend
    return "torch"


def tiny_config(config: dict, algo: str) -> tuple[dict, list[str]]:
    """A copy of a resolved recipe with the tiny CPU settings, and the changes made (`key: old -> new`)."""
    d = copy.deepcopy(config)
    ch: list[str] = []
    tiny_model = tiny_stand_in(str((d.get("model") or {}).get("path") or ""), vlm=algo.startswith("vlm_"))
    _set(ch, d, "model.path", tiny_model)
    _set(ch, d, "model.dtype", "auto")
    _set(ch, d, "model.trust_remote_code", False)
    _cap(ch, d, "model.max_seq_len", MAX_SEQ_LEN)
    seq = d["model"].get("max_seq_len", MAX_SEQ_LEN)

    env = d.setdefault("env", {})
    _set(ch, d, "env.url", None)
    preset = _tiny_preset(str(env.get("name", "")))
    if preset is not None:
        _set(ch, d, "env.preset", preset)
    _cap(ch, d, "env.max_rollout_tokens", seq)

    data = d.setdefault("data", {})
    prepare = data.get("prepare") if isinstance(data.get("prepare"), dict) else {}
    _set(ch, d, "data.train", None)
    _set(ch, d, "data.eval", None)
    _set(ch, d, "data.prepare", {
        "n_train": min(int(prepare.get("n_train") or N_TRAIN), N_TRAIN),
        "n_eval": min(int(prepare.get("n_eval") if prepare.get("n_eval") is not None else N_EVAL), N_EVAL),
        "preset": env.get("preset"), "knobs": (prepare.get("knobs") or {}) if preset is None else {},
        "seed": prepare.get("seed", d.get("seed", 0)),
    })

    keep_vllm = vllm_runs_stand_in(tiny_model)
    gen = d.get("generation", {}).get("backend")
    _set(ch, d, "generation.backend", "vllm" if gen == "vllm" and keep_vllm else "hf")
    _cap(ch, d, "generation.max_new_tokens", MAX_NEW_TOKENS)
    if d.get("generation", {}).get("vllm") is not None:  # read by the vllm backend only

        _set(ch, d, "generation.vllm", VllmSection().model_dump())
    if isinstance(d.get("vision"), dict):
        _set(ch, d, "vision.dedup_payloads", True)

    training_backend = _tiny_training_backend(d.get("training", {}).get("backend"), tiny_model)
    _set(ch, d, "training.backend", training_backend)
    if training_backend == "fsdp2":
        _set(ch, d, "training.fsdp.cpu_offload", False)  # host memory is where a CPU run's weights already are
    _set(ch, d, "training.dtype", "auto")
    wired = TRAINING_BACKENDS.capabilities(training_backend).model_parallel
    asked = ((d.get("training") or {}).get("parallel") or {})
    sizes = {k: _tiny_size(asked.get(k, 1), k in wired) for k in PARALLEL_SIZES}
    replica = sizes["tensor"] * sizes["pipeline"] * sizes["context"]
    if "expert" in wired:
        # each expert whole (expert TP 1): the EP group folds over the replica's tensor and context ranks, so
        # it keeps up to as many ranks as those, and as the tiny Omni's routed experts (TP2 x CP2 x EP4 on four
        # ranks: one expert a rank)
        sizes["expert"] = min(int(asked.get("expert", 1)), max(MAX_PARALLEL, replica), TinyKnobs.experts)
    for k, size in sizes.items():
        _set(ch, d, f"training.parallel.{k}", size)
    # one data-parallel replica of the kept layout, and whole EP groups
    model_parallel = math.lcm(replica, sizes["expert"])
    if model_parallel > 1:
        _set(ch, d, "cluster.cpu_training_ranks", model_parallel)
    _set(ch, d, "training.global_batch_size", None)  # refilled: the samples of one (smaller) step

    if d.get("refit", {}).get("transport") in _gpu_transports():
        _set(ch, d, "refit.transport", "object_store")

    for key, value in (("num_nodes", 1), ("gpus_per_node", 0), ("colocated", True), ("generation_gpus", None),
                       ("training_gpus", None), ("ray_address", None)):
        _set(ch, d, f"cluster.{key}", value)

    _set(ch, d, "cluster.placement", PlacementSection().model_dump())  # a laptop has none of a cluster's node pins

    base = algo.removeprefix("vlm_")
    for key, cap in (("prompts_per_step", MAX_PROMPTS), ("generations_per_prompt", MAX_GENERATIONS),
                     ("batch_size", MAX_BATCH), ("val_prompts", MAX_VAL_PROMPTS)):
        _cap(ch, d, f"{base}.{key}", cap)
    if (d.get(base) or {}).get("overlong_filtering"):
        # a stand-in's turns run to the capped budget: filtering them would leave no sample to train on
        _set(ch, d, f"{base}.overlong_filtering", False)
    teachers = (d.get("mopd") or {}).get("teachers") if base == "mopd" else None
    for alias, t in sorted((teachers or {}).items()):
        if not isinstance(t, dict):
            continue
        _set(ch, d, f"mopd.teachers.{alias}.path", tiny_model)  # a teacher shares the student's tokenizer
        _set(ch, d, f"mopd.teachers.{alias}.backend", _tiny_teacher_backend(t.get("backend"), tiny_model, keep_vllm))
        if t.get("engine_kwargs") and d["mopd"]["teachers"][alias]["backend"] != "vllm":
            _set(ch, d, f"mopd.teachers.{alias}.engine_kwargs", {})  # vLLM's arguments, for a torch stand-in
        teacher_backend = d["mopd"]["teachers"][alias]["backend"]
        caps = TEACHER_BACKENDS.capabilities(teacher_backend)
        spans = {}
        for size, kind in (("tensor_parallel_size", "tensor"), ("expert_parallel_size", "expert")):
            # a CPU replica of several ranks (megatron) keeps its structure at tiny size; an engine spans nothing
            spans[size] = _tiny_size(t.get(size, 1), caps.rank_per_device and kind in caps.model_parallel)
            if size in t:
                _set(ch, d, f"mopd.teachers.{alias}.{size}", spans[size])
        ranks = spans["tensor_parallel_size"] > 1
        _set(ch, d, f"mopd.teachers.{alias}.placement", "separate" if ranks else "colocated")
        _set(ch, d, f"mopd.teachers.{alias}.gpus", None)
        _cap(ch, d, f"mopd.teachers.{alias}.data_parallel_size", MAX_TEACHER_REPLICAS)

    _set(ch, d, "logger.wandb", False)  # no network in a smoke run
    _set(ch, d, "logger.tensorboard", False)
    return d, ch
