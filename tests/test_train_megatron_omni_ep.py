"""`gymv train` with training.backend megatron at training.parallel.expert 2: the tiny Nemotron 3 Omni's routed
experts split over two gloo trainer ranks that hold different samples. Three GRPO steps equal the torch
backend's on the same rollouts (loss, gradient norm and the router's balancing terms: one sample a
micro-batch on both sides, so each micro-batch's router terms are the same tokens'), and the refits (experts
gathered over the EP ranks) keep the generator in agreement with the trainer."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from gymv.train import train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import ray_module, tiny_grpo_settings, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow
RECIPE = "vlm_grpo.yaml"


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def run(tmp, backend: str, expert: int) -> list[dict]:
    settings = tiny_grpo_settings(tmp, tiny_path("tiny-nemotron-omni"), **{
        "generation.chat_template_kwargs": {"enable_thinking": False}, "training.backend": backend,
        "training.dtype": "float32", "training.eps": 1.0e-3, "training.micro_batch_tokens": 1,
        "training.parallel.expert": expert, "cluster.cpu_training_ranks": expert, "checkpoint.period": 3})
    train(write_recipe(tmp, f"omni-{backend}", RECIPE, settings))
    lines = (tmp / "runs" / f"omni-{backend}" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/loss" in m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {"megatron": run(tmp_path_factory.mktemp("ep2"), "megatron", 2),
            "torch": run(tmp_path_factory.mktemp("torch"), "torch", 1)}


def test_three_grpo_steps_at_ep2_equal_the_torch_backends_with_the_same_router_metrics(runs):
    megatron, torch_ = runs["megatron"], runs["torch"]
    assert len(megatron) == len(torch_) == 3
    for m, t in zip(megatron, torch_):
        assert m["train/loss"] == pytest.approx(t["train/loss"], abs=1e-5)
        assert m["train/grad_norm"] > 0
        assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=1e-4)
        for key in ("train/moe_aux_loss", "train/moe_load_max"):
            assert m[key] == pytest.approx(t[key], rel=1e-4), key


def test_refits_at_ep2_keep_the_generator_in_agreement_with_the_trainer(runs):
    for m in runs["megatron"]:
        assert m["train/token_mult_prob_error"] < 1.05
