"""Each model family end to end through a short GRPO run (`gymv train` on a real local Ray): rollouts on a
built-in environment (images in every VLM prompt; arithmetic for text-only models), a training step, the
refit, and a generator that agrees with the trainer."""

from __future__ import annotations

import json

import pytest

from gymv.train import train
from tiny_models import tiny_path
from train_helpers import ray_module, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow

# Every family added by the model-family work runs `gymv train` end to end here, about 10-30 s each (tiny-llava
# and tiny-qwen2vl, the first two, run it throughout the rest of the suite).
FAMILIES = ["tiny-qwen2_5vl", "tiny-gemma3", "tiny-qwen3", "tiny-qwen3vl", "tiny-llava-next", "tiny-llava-onevision",
            "tiny-smolvlm", "tiny-llama", "tiny-nemotron-omni"]


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_short_grpo_run_trains_each_family(tmp_path, arch):
    from gymv.models.tiny import TEXT_ONLY_ARCHES

    text = arch in TEXT_ONLY_ARCHES
    settings = tiny_grpo_settings(tmp_path, tiny_path(arch), **{
        "env.name": "arithmetic" if text else "circle-count", "env.preset": "tiny", "env.max_turns": 1,
        "grpo.max_steps": 1, "generation.max_new_tokens": 4, "model.max_seq_len": 512})
    recipe = write_recipe(tmp_path, f"grpo-{arch}", "grpo.yaml" if text else "vlm_grpo.yaml", settings)
    train(recipe)
    [m] = [json.loads(line) for line in (tmp_path / "runs" / f"grpo-{arch}" / "metrics.jsonl").read_text().splitlines()
           if "train/loss" in line]
    assert m["train/token_mult_prob_error"] < 1.05
