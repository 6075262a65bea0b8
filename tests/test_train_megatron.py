"""`gymv train` with training.backend megatron (Megatron-core's GPTModel on the CPU, gloo) on the tiny Qwen3:
the first GRPO step's loss equals the torch backend's on the same rollouts, refits keep the generator in
agreement with the trainer, and the checkpoint is an HF folder that loads and resumes."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.train import train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import model_weights, ray_module, tiny_grpo_settings, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow
ARCH = "tiny-qwen3"


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def run(tmp, backend: str, steps: int = 3) -> tuple[list[dict], object]:
    settings = tiny_grpo_settings(tmp, tiny_path(ARCH), **{
        "env.name": "even-length-text", "grpo.max_steps": steps, "training.backend": backend,
        "training.dtype": "float32", "training.eps": 1.0e-3})
    train(write_recipe(tmp, f"grpo-{backend}", "grpo.yaml", settings))
    run_dir = tmp / "runs" / f"grpo-{backend}"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/loss" in m], run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {b: run(tmp_path_factory.mktemp(b), b) for b in ("megatron", "torch")}


def test_each_steps_loss_and_gradient_norm_equal_the_torch_backends(runs):
    """Same seed, same rollouts: the steps differ only by fp32 summation order (the first step's GRPO loss is
    0 on policy, so its gradient norm is the sharper check)."""
    megatron, torch_ = runs["megatron"][0], runs["torch"][0]
    assert len(megatron) == len(torch_) == 3
    for m, t in zip(megatron, torch_):
        assert m["train/loss"] == pytest.approx(t["train/loss"], abs=1e-5)
        assert m["train/grad_norm"] > 0
        assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=1e-5)


def test_refits_keep_the_generator_in_agreement_with_the_trainer(runs):
    for m in runs["megatron"][0]:
        assert m["train/token_mult_prob_error"] < 1.05


def test_the_last_checkpoint_is_an_hf_folder_with_the_torch_backends_weights(runs):
    got = model_weights(runs["megatron"][1] / "checkpoints" / "step_3")
    want = model_weights(runs["torch"][1] / "checkpoints" / "step_3")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)
