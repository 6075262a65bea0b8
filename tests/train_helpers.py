"""Shared pieces of the `gymv train` tests: the plugin test environment on every process's path, one Ray
session shared by the test modules, tiny recipes written next to the run, and weight reading."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = Path(__file__).resolve().parent / "train_plugin"


def plugin_env() -> dict:
    """Environment variables under which subprocesses (and Ray workers) find the test environment plugin."""
    path = os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}


@contextmanager
def plugin_on_path():
    """The test plugin importable here and in every child process (Ray workers, `gymv` subprocesses) until
    the block ends; sys.path and PYTHONPATH are restored afterwards, so other test modules never see it."""
    old_path, old_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(PLUGIN_DIR))
    os.environ.update(plugin_env())
    try:
        yield
    finally:
        sys.path[:] = old_path
        if old_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_env


@contextmanager
def ray_module():
    """The test session's local Ray, for a module: started by the first module that asks and kept for the next
    (a start costs several seconds on 2 cores; tests/conftest.py stops it when the session ends), with the test
    plugin on this process's path while the module runs. Its workers inherit PYTHONPATH from the start, so they
    see the plugin. A module that needs no Ray running (it checks that nothing started one, or it joins a
    cluster of its own) calls `no_shared_ray()` first."""
    import ray

    from gymv.cluster.ray_cluster import start_ray

    with plugin_on_path():
        if not ray.is_initialized():
            start_ray()
        yield


def ray_session():
    """`ray_module()` for fixtures written as `stop = ray_session(); yield; stop()`."""
    cm = ray_module()
    cm.__enter__()
    return lambda: cm.__exit__(None, None, None)


def no_shared_ray() -> None:
    """Stop the session's local Ray, if one is up (the next module that asks for it starts it again)."""
    import ray

    from gymv.cluster.ray_cluster import stop_ray

    if ray.is_initialized():
        stop_ray()


def write_recipe(dir: Path, name: str, exemplar: str, settings: dict) -> Path:
    """A recipe inheriting a repo exemplar, with `settings` (dotted keys) written as its own leaves."""
    data: dict = {"defaults": str(REPO / "recipes" / exemplar)}
    for key, value in settings.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    path = dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tiny_grpo_settings(tmp: Path, model_path: Path, **extra) -> dict:
    """2 prompts x 2 generations, 8 new tokens, the even-length plugin env: a GRPO step in about a second."""
    settings = {
        "model.path": str(model_path), "model.max_seq_len": 256,
        "env.name": "even-length",
        "data.prepare.n_train": 8, "data.prepare.n_eval": 2,
        "generation.max_new_tokens": 8,
        "training.lr": 1.0e-3,
        "grpo.prompts_per_step": 2, "grpo.generations_per_prompt": 2, "grpo.max_steps": 3,
        "grpo.val_period": 0, "grpo.val_prompts": 2, "grpo.loss.kl_coef": 0.0,
        "checkpoint.dir": str(tmp / "runs"), "checkpoint.period": 1, "checkpoint.keep": 5,
        "cluster.ray_address": None,
    }
    settings.update(extra)
    return settings


def read_weights(folder: Path) -> dict:
    """The tensors of a folder's model.safetensors as stored (compare folders written the same way)."""
    import safetensors.torch as st

    return st.load_file(str(Path(folder) / "model.safetensors"))


def model_weights(folder: Path) -> dict:
    """The weights by the model's own parameter names, whichever key layout the folder was saved with
    (save_pretrained may write a checkpoint's original layout; gymv checkpoints use module names)."""
    from gymv.backends.policy import load_policy

    return load_policy(folder).model.state_dict()


def step_timing(*phases: str, rates: tuple[str, ...] = ()) -> set[str]:
    """The `timing/*` keys a step's PhaseTimer (gymv.timing) writes for its clock, these phases and these rates:
    a row whose timing keys are exactly these has no duration measured outside the timer, and none missing."""
    from gymv.timing import phase_key

    return {phase_key(p) for p in ("step", *phases)} | {f"timing/{r}_per_s" for r in rates}


def timing_keys(row: dict) -> set[str]:
    return {k for k in row if k.startswith("timing/")}


def sync_phases() -> tuple[str, ...]:
    """The phases of a synchronous GRPO (and MOPD) step: the rollout round trip, the environment's seconds and
    generation's split inside it (the slowest worker's), the trainer's passes, the refit."""
    from gymv.rollout.loop import BREAKDOWN

    return ("generation", "env", *(f"generation/{b.removesuffix('_s')}" for b in BREAKDOWN),
            "logprobs", "training", "train_step", "refit")


ROLLOUT_RATES = ("generation_tokens", "tokens")  # generated tokens per generation second, all tokens per step second
