"""The CPU quickstart's first steps, to the digit: its two recipes (SFT warm start, then GRPO from it) on the same
tiny model, data and seeds give exactly these losses, gradient norms and rewards (in the manner of torchtune's
recipe tests). The learning tests judge where a run goes; this one fails on any change to what the first steps
compute: a loss, an advantage, a sampler, a data order. A change that means to move them updates the table and
says why in its commit."""

from __future__ import annotations

import json

import pytest

from gymv.checks.evaluate import MetricSeries
from gymv.models.tiny import init_tiny
from gymv.train import train
from train_helpers import ray_module, write_recipe

pytestmark = pytest.mark.slow

STEPS = 3
SFT_STEPS = 100  # the quickstart's: GRPO starts where the quickstart's GRPO starts
SFT_AT = (1, 2, 3, 100)  # the steps of SFT whose figures are recorded
SFT = {"train/loss": [7.016932010650635, 6.970557689666748, 6.872476577758789, 0.215158149600029],
       "train/grad_norm": [9.411856651306152, 9.381441116333008, 9.127823829650879, 1.6188429594039917]}
GRPO = {"train/loss": [-0.04075586423277855, -0.07748615741729736, -0.12632670998573303],
        "train/grad_norm": [1.2495564222335815, 1.021470308303833, 3.274975299835205],
        "train/reward_mean": [0.328125, 0.3125, 0.25]}


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def _series(run, keys) -> dict[str, list[float]]:
    metrics = MetricSeries.from_run(run)
    return {k: metrics.values(k) for k in keys}


def test_the_quickstarts_first_sft_and_grpo_steps_give_the_recorded_figures(tmp_path):
    runs = tmp_path / "runs"
    model = init_tiny("tiny-llava", tmp_path / "model", layers=1, vision_layers=1)
    common = {"checkpoint.dir": str(runs), "cluster.ray_address": None}
    train(write_recipe(tmp_path, "sft", "vlm/vlm_sft-tinyllava-1n0g-torch.yaml", {
        **common, "model.path": str(model), "sft.max_steps": SFT_STEPS, "sft.val_period": 0,
        "checkpoint.period": SFT_STEPS}))
    train(write_recipe(tmp_path, "grpo", "vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", {
        **common, "model.path": str(runs / "sft" / "final"), "grpo.max_steps": STEPS, "grpo.val_period": 0,
        "grpo.val_at_start": False, "checkpoint.period": STEPS}))
    sft = {k: [v[i - 1] for i in SFT_AT] for k, v in _series(runs / "sft", SFT).items()}
    grpo = _series(runs / "grpo", GRPO)
    print(json.dumps({"sft": sft, "grpo": grpo}))
    for got, want in ((sft, SFT), (grpo, GRPO)):
        assert set(got) == set(want)
        for key, values in want.items():
            assert got[key] == pytest.approx(values, rel=1e-4, abs=1e-6), key
