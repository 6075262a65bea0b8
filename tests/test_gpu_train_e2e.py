"""`gymv train` on CUDA end to end, as a user runs it: the CLI in a fresh interpreter, a real local Ray, tiny
models built here, a few steps each, on one GPU with generation and training colocated (docs/training.md,
"Running a recipe on one GPU"). GRPO with the HF decoding loop and with the static decoder, the fsdp2 backend,
MOPD with a torch teacher, the tiny Nemotron 3 Omni recipe, and async GRPO (two GPUs: on one, async is refused).

The runs are marked `gpu` and skip without CUDA (tests/conftest.py). The unmarked tests check, on any machine,
that every recipe the GPU runs use passes `gymv lint`, so that a GPU session meets no recipe error. The CPU
twins of these runs: test_train_grpo.py, test_train_grpo_async.py, test_mopd_train.py, test_train_fsdp.py and
test_train_nemotron_omni.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import CLI_ENV
from tiny_models import tiny_path
from train_helpers import plugin_env, tiny_grpo_settings, write_recipe

gpu = pytest.mark.gpu

ONE_GPU = {"cluster.num_nodes": 1, "cluster.gpus_per_node": 1, "cluster.colocated": True,
           "refit.transport": "auto", "refit.check.every": 1,  # every refit proven (digest) on the engines
           "model.dtype": "bfloat16", "training.dtype": "bfloat16"}
TWO_GPUS_SPLIT = {**ONE_GPU, "cluster.gpus_per_node": 2, "cluster.colocated": False,
                  "cluster.generation_gpus": 1, "cluster.training_gpus": 1}
BF16_BOUND = 1.05  # median token_mult_prob_error NeMo RL's nightly tests accept (grpo.logprob_error_guard)
RUN_TIMEOUT_S = 420  # one `gymv train`, Ray's start and the CUDA contexts included
FINITE_KEYS = ("train/loss", "train/grad_norm", "train/token_mult_prob_error", "train/reward_mean",
               "timing/step_s", "timing/generation_s", "timing/training_s", "timing/refit_s")


@dataclass
class Run:
    """What one `gymv train` left: its --json summary, the run directory, its metrics rows, placement.json."""
    code: int
    summary: dict
    dir: Path
    rows: list[dict] = field(default_factory=list)
    placement: dict = field(default_factory=dict)
    stderr: str = ""

    @property
    def transport(self) -> str | None:
        return self.placement.get("refit_transport")

    def checkpoints(self) -> list[str]:
        from gymv.runs.checkpoint import list_checkpoints

        return [p.name for _, p in list_checkpoints(self.dir)]


def gpu_recipe(tmp: Path, name: str, exemplar: str, settings: dict, cluster: dict = ONE_GPU) -> Path:
    """A recipe of the tiny model `settings` name, placed on GPUs by `cluster` (one GPU, colocated: default)."""
    return write_recipe(tmp, name, exemplar, {**settings, **cluster, "name": name})


def gymv_train(recipe: Path, *flags: str, timeout: float = RUN_TIMEOUT_S) -> Run:
    """`gymv train RECIPE --json` in a fresh interpreter started in the recipe's folder (so that the installed
    `gymv` is the one imported, not a source tree's `gymv_cli` without its commands), the test plugin
    environment on PYTHONPATH for Ray's workers. A run still going at `timeout` is killed with every process it
    started (its local Ray too) and reported as exit code 124."""
    env = {**os.environ, **CLI_ENV, **plugin_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "train", str(recipe), "--json", *flags],
                            cwd=recipe.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code, err = 124, f"{err}\nkilled after {timeout:.0f} s"
    start = out.find("{")
    summary = json.loads(out[start:]) if code == 0 and start >= 0 else {}
    name = recipe.stem
    run_dir = Path(summary.get("run_dir") or recipe.parent / "runs" / name)
    if not run_dir.is_absolute():
        run_dir = recipe.parent / run_dir
    metrics, placement = run_dir / "metrics.jsonl", run_dir / "placement.json"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return Run(code, summary, run_dir, rows, json.loads(placement.read_text()) if placement.exists() else {}, err)


def finished(run: Run, steps: int) -> None:
    """The run exited 0 with every step logged, each with finite figures, and its final checkpoint written."""
    assert run.code == 0, run.stderr[-4000:]
    assert run.summary["complete"] and [r["step"] for r in run.rows] == list(range(1, steps + 1))
    for r in run.rows:
        for key in FINITE_KEYS:
            assert key in r and math.isfinite(r[key]), (r["step"], key, r.get(key))
    assert f"step_{steps}" in run.checkpoints()
    assert (run.dir / "final" / "config.json").exists()


def within_bf16_bound(run: Run) -> None:
    errors = [r["train/token_mult_prob_error"] for r in run.rows]
    assert all(1.0 <= e < BF16_BOUND for e in errors), errors


def grpo_settings(tmp: Path, **extra) -> dict:
    """The CPU tests' tiny GRPO (2 prompts x 2 generations, 8 new tokens, the even-length plugin environment),
    3 steps, a checkpoint every step; runs under the test's own folder."""
    return tiny_grpo_settings(tmp, tiny_path("tiny-llava"), **{"checkpoint.dir": "runs", **extra})


def mopd_settings(tmp: Path) -> dict:
    """The tiny LLaVA student distilling from a smaller tiny LLaVA (same tokenizer, other weights) scored by the
    torch teacher backend, colocated on the policy's GPU, on circle-count's tiny preset."""
    from gymv.models.tiny import init_tiny

    teacher = tmp / "teacher"
    if not teacher.exists():
        init_tiny("tiny-llava", teacher, hidden=64, layers=1)
    return {
        "model.path": str(tiny_path("tiny-llava")), "model.max_seq_len": 256,
        "data.prepare.n_train": 8, "data.prepare.n_eval": 2, "generation.max_new_tokens": 6,
        "training.lr": 1.0e-3, "mopd.prompts_per_step": 2, "mopd.max_steps": 2, "mopd.val_period": 0,
        "mopd.val_prompts": 2,
        "mopd.teachers": {"_override_": True, "teacher": {"path": str(teacher), "backend": "torch",
                                                          "placement": "colocated"}},
        "checkpoint.dir": "runs", "checkpoint.period": 1, "cluster.ray_address": None,
    }


def omni_settings() -> dict:
    """The tiny Omni recipe as it stands (circle-count tiny, thinking off, 8 generations a prompt), shrunk to
    2 prompts a step, 3 steps, no validation."""
    return {"model.path": str(tiny_path("tiny-nemotron-omni")), "data.prepare.n_train": 16,
            "data.prepare.n_eval": 4, "grpo.prompts_per_step": 2, "grpo.max_steps": 3, "grpo.val_period": 0,
            "grpo.val_at_start": False, "grpo.val_prompts": 4, "checkpoint.dir": "runs", "checkpoint.period": 3,
            "cluster.ray_address": None}


ASYNC = {"grpo.async.enabled": True, "grpo.importance_sampling.kind": "truncated"}  # what `--async` needs

# name -> (exemplar, settings builder, cluster): every recipe the GPU runs below use, linted on any machine
RECIPES = {
    "grpo-eager": ("vlm_grpo.yaml", lambda t: grpo_settings(t, **{"generation.decode": "eager"}), ONE_GPU),
    "grpo-static": ("vlm_grpo.yaml", lambda t: grpo_settings(t, **{"generation.decode": "static",
                                                                  "refit.transport": "cuda_ipc"}), ONE_GPU),
    "grpo-fsdp2": ("vlm_grpo.yaml", lambda t: grpo_settings(t, **{"training.backend": "fsdp2"}), ONE_GPU),
    "mopd-torch-teacher": ("vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", mopd_settings, ONE_GPU),
    "omni": ("vlm/vlm_grpo-tinyomni-1n0g-torch.yaml", lambda t: omni_settings(), ONE_GPU),
    "grpo-async-2gpu": ("vlm_grpo.yaml", lambda t: grpo_settings(t, **ASYNC, **{"grpo.max_steps": 4}), TWO_GPUS_SPLIT),
}


def recipe_for(tmp: Path, name: str) -> Path:
    exemplar, settings, cluster = RECIPES[name]
    return gpu_recipe(tmp, name, exemplar, settings(tmp), cluster)


def run_named(tmp_path_factory, name: str, *flags: str) -> Run:
    tmp = tmp_path_factory.mktemp(name)
    return gymv_train(recipe_for(tmp, name), *flags)


# ------------------------------------------------------------------------------------------ on any machine

@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_the_gpu_runs_use_passes_lint(gymv, tmp_path, name):
    result = gymv("lint", str(recipe_for(tmp_path, name)), "--format", "text")
    assert result.code == 0, result.stdout + result.stderr


def test_async_grpo_on_one_colocated_gpu_is_refused_before_anything_starts(gymv, tmp_path):
    recipe = gpu_recipe(tmp_path, "async-one-gpu", "vlm_grpo.yaml", grpo_settings(tmp_path, **ASYNC))
    result = gymv("train", str(recipe), "--async", cwd=tmp_path, env=plugin_env())
    assert result.code == 2 and "cluster.colocated" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ on one GPU

@pytest.fixture(scope="module")
def grpo_eager(tmp_path_factory):
    return run_named(tmp_path_factory, "grpo-eager")


@gpu
def test_grpo_runs_three_steps_on_one_gpu_with_finite_metrics_and_checkpoints(grpo_eager):
    finished(grpo_eager, 3)


@gpu
def test_colocated_on_one_gpu_auto_refits_through_cuda_ipc(grpo_eager):
    assert grpo_eager.transport == "cuda_ipc", grpo_eager.placement
    workers = [w for role in grpo_eager.placement["roles"].values() for w in role["workers"]]
    assert workers and {str(w["gpus"]) for w in workers} == {str(workers[0]["gpus"])}  # every worker on one GPU


@gpu
def test_colocated_workers_report_their_peak_memory_and_hand_their_cache_back_every_step(grpo_eager):
    for r in grpo_eager.rows:
        for phase in ("training", "generation"):
            assert 0 < r[f"memory/{phase}_peak_gb"] <= r[f"memory/{phase}_reserved_gb"], r
            assert r[f"memory/{phase}_released_gb"] >= 0, r


@gpu
def test_bf16_generation_and_training_agree_within_the_bound(grpo_eager):
    within_bf16_bound(grpo_eager)


@gpu
def test_the_eager_decoder_captures_no_graphs(grpo_eager):
    assert all(r.get("timing/generation/backend_capture_s", 0.0) == 0.0 for r in grpo_eager.rows)


@pytest.fixture(scope="module")
def grpo_static(tmp_path_factory):
    return run_named(tmp_path_factory, "grpo-static")


@gpu
def test_the_static_decoder_trains_three_steps_refitting_through_an_explicit_cuda_ipc(grpo_static):
    finished(grpo_static, 3)
    assert grpo_static.transport == "cuda_ipc"
    within_bf16_bound(grpo_static)


@gpu
def test_the_static_decoder_captures_cuda_graphs_on_its_first_step(grpo_static):
    assert grpo_static.rows[0]["timing/generation/backend_capture_s"] > 0


@pytest.fixture(scope="module")
def grpo_fsdp2(tmp_path_factory):
    return run_named(tmp_path_factory, "grpo-fsdp2")


@gpu
def test_fsdp2_on_one_gpu_trains_and_refits_through_cuda_ipc(grpo_fsdp2):
    finished(grpo_fsdp2, 3)
    assert grpo_fsdp2.transport == "cuda_ipc"
    within_bf16_bound(grpo_fsdp2)


@pytest.fixture(scope="module")
def mopd(tmp_path_factory):
    return run_named(tmp_path_factory, "mopd-torch-teacher")


@gpu
def test_mopd_with_a_colocated_torch_teacher_distils_on_one_gpu(mopd):
    finished(mopd, 2)
    for r in mopd.rows:
        assert math.isfinite(r["train/kl_teacher"]) and math.isfinite(r["timing/teacher_s"])
    assert mopd.transport == "cuda_ipc"
    within_bf16_bound(mopd)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    return run_named(tmp_path_factory, "omni")


@gpu
def test_the_tiny_omni_recipe_trains_on_one_gpu(omni, record_property):
    from gymv.backends import mamba_kernels

    # mamba_ssm's Triton kernels where installed, else the torch scan: recorded (junit xml, -rA), not required
    why = mamba_kernels.why_not("cuda")
    record_property("mamba_kernels", "mamba_ssm" if why is None else f"torch fallback: {why}")
    print(f"mamba kernels: {'mamba_ssm' if why is None else 'torch fallback: ' + why}")
    finished(omni, 3)
    assert omni.transport == "cuda_ipc"
    within_bf16_bound(omni)
    for r in omni.rows:  # the MoE routers' balancing terms, logged every step (training.moe)
        assert math.isfinite(r["train/moe_aux_loss"]) and r["train/moe_load_max"] >= 1.0


# ------------------------------------------------------------------------------------------ on two GPUs

def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.device_count() >= 2
    except Exception:
        return False


@gpu
@pytest.mark.skipif(not _two_gpus(), reason="async GRPO on GPUs generates and trains on separate GPUs: needs 2")
def test_async_grpo_on_two_gpus_trains_on_samples_at_most_one_step_old(tmp_path_factory):
    run = run_named(tmp_path_factory, "grpo-async-2gpu", "--async")
    finished(run, 4)
    assert all(r["async/age_max"] <= 1.0 for r in run.rows)
    assert run.transport in ("nccl", "object_store"), run.placement
