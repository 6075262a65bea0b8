"""A worker's GPU memory over a phase (gymv.cluster.device_memory): what a step's row says about it, and the cache
a worker sharing its GPU hands back. The CUDA cases skip without a GPU; the e2e GPU tests check the rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymv.checks import is_known_metric
from gymv.cluster.device_memory import phase_memory
from gymv.cluster.group import rollout_memory
from gymv.config import load_recipe
from gymv.train.setup import worker_spec

RECIPE = Path(__file__).resolve().parents[1] / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"


def spec(*overrides: str):
    return worker_spec(load_recipe(RECIPE, overrides=list(overrides)).validated, "m")


def test_a_phase_on_the_cpu_reports_no_memory():
    assert phase_memory("cpu", "training", release=True) == {}


def test_only_generation_and_training_on_one_gpu_share_it():
    assert not spec().shares_gpu
    assert spec("cluster.gpus_per_node=1", "cluster.colocated=true").shares_gpu
    assert not spec("cluster.gpus_per_node=2", "cluster.colocated=false", "cluster.generation_gpus=1", "cluster.training_gpus=1").shares_gpu


def test_the_memory_keys_are_metrics_a_check_may_name():
    assert all(is_known_metric(f"memory/{phase}_{k}") for phase in ("training", "generation")
               for k in ("peak_gb", "reserved_gb", "released_gb"))


def test_a_steps_generation_memory_is_the_largest_of_its_workers():
    stats = [{"env_s": 1.0, "memory/generation_peak_gb": 3.0}, {"memory/generation_peak_gb": 5.0}, {"env_s": 2.0}]
    assert rollout_memory(stats) == {"memory/generation_peak_gb": 5.0}
    assert rollout_memory([{"env_s": 1.0}]) == {}


@pytest.mark.gpu
def test_a_shared_gpu_phase_reports_its_peak_and_hands_its_cache_back():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    phase_memory("cuda", "warmup", release=True)
    block = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")  # 0.25 GB
    del block
    out = phase_memory("cuda", "training", release=True)
    assert out["memory/training_peak_gb"] >= 0.25 and out["memory/training_reserved_gb"] >= 0.25
    assert out["memory/training_released_gb"] >= 0.25
    kept = phase_memory("cuda", "training", release=False)
    assert kept["memory/training_peak_gb"] < 0.25 and "memory/training_released_gb" not in kept
