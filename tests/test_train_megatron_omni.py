"""`gymv train` with training.backend megatron on the tiny Nemotron 3 Omni (gymv's Megatron hybrid model on
the CPU: RADIO tower and projector as HF modules, Mamba-2 / attention / MoE decoder): three GRPO steps of the
tiny Omni (a picture and a prompt a row, reasoning off; the even-length test environment, whose rewards vary
from the first step) equal the torch backend's on the same rollouts, with the router's balancing terms logged
under the same names, and refits keep the generator in agreement with the trainer. So do they at tensor 2 x
expert 4 over four gloo trainer ranks: each expert whole on its rank (expert TP 1), one EP group spanning both
data-parallel replicas, which hold different samples, and both TP ranks of each, which dispatch half the
tokens each (experts gathered over the EP ranks at each refit).

Every run takes one sample a micro-batch, so each micro-batch's router terms are the same tokens' on both
sides; the megatron runs share one torch run and one local Ray."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from gymv.train import train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import ray_module, tiny_grpo_settings, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow
RECIPE = "vlm_grpo.yaml"
LAYOUTS = {"torch": ("torch", 1, 1), "megatron": ("megatron", 1, 1),
           "megatron-tp2-ep4": ("megatron", 2, 4)}  # (backend, tensor, expert) over `expert` trainer ranks
MEGATRON = [name for name in LAYOUTS if name != "torch"]


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def run(tmp, name: str) -> list[dict]:
    backend, tensor, expert = LAYOUTS[name]
    settings = tiny_grpo_settings(tmp, tiny_path("tiny-nemotron-omni"), **{
        "generation.chat_template_kwargs": {"enable_thinking": False}, "training.backend": backend,
        "training.dtype": "float32", "training.eps": 1.0e-3, "training.micro_batch_tokens": 1,
        "training.parallel.tensor": tensor, "training.parallel.expert": expert, "cluster.cpu_training_ranks": expert,
        "checkpoint.period": 3})
    train(write_recipe(tmp, f"omni-{name}", RECIPE, settings))
    lines = (tmp / "runs" / f"omni-{name}" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "train/loss" in m]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: run(tmp_path_factory.mktemp(name), name) for name in LAYOUTS}


@pytest.mark.parametrize("layout", MEGATRON)
def test_three_grpo_steps_equal_the_torch_backends_with_the_same_router_metrics(runs, layout):
    megatron, torch_ = runs[layout], runs["torch"]
    assert len(megatron) == len(torch_) == 3
    for m, t in zip(megatron, torch_):
        assert m["train/loss"] == pytest.approx(t["train/loss"], abs=1e-5)
        assert m["train/grad_norm"] > 0
        assert m["train/grad_norm"] == pytest.approx(t["train/grad_norm"], rel=1e-4)
        for key in ("train/moe_aux_loss", "train/moe_load_max"):
            assert m[key] == pytest.approx(t[key], rel=1e-4), key


@pytest.mark.parametrize("layout", MEGATRON)
def test_refits_keep_the_generator_in_agreement_with_the_trainer(runs, layout):
    for m in runs[layout]:
        assert m["train/token_mult_prob_error"] < 1.05
