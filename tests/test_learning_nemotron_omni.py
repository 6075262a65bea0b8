"""The tiny Nemotron 3 Omni learns on a CPU (docs/models.md, "Learning on the CPU"): the SFT warm start then GRPO
on circle-count raises held-out accuracy by at least 10 points, and MOPD from the same warm start, taught by a
longer-trained SFT of the same model, closes at least half of the gap to that teacher.

One SFT run on the recipes' own rows gives both ends: its step-80 checkpoint is the warm start (the recipe's
own stopping point), its step-100 export the teacher. Fewer GRPO steps than the recipe (100), all 400
held-out rows. Learning is
judged on smoothed measures (the mean of the validations after the first quarter), since one validation
swings by 10 points or more at this scale.
"""

from __future__ import annotations

from statistics import mean

import pytest

from gymv.checks.evaluate import MetricSeries
from gymv.train import train
from train_helpers import ray_module, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The SFT run (warm start at step 80, teacher at step 100) on the recipes' own rows, and the run folder.
    It validates once, at step 100: the teacher's accuracy is the one SFT figure the tests read."""
    tmp = tmp_path_factory.mktemp("omni-learning")
    common = {"checkpoint.dir": str(tmp / "runs"), "cluster.ray_address": None}
    train(write_recipe(tmp, "sft", "vlm/vlm_sft-tinyomni-1n0g-torch.yaml",
                       {**common, "sft.max_steps": 100, "sft.val_period": 100, "checkpoint.period": 20}))
    return tmp, common


def _val(run) -> list[float]:
    return MetricSeries.from_run(run).values("val/accuracy")


def _max_error(run) -> float:
    return max(MetricSeries.from_run(run).values("train/token_mult_prob_error"))


@pytest.mark.timeout(2400)
def test_sft_then_grpo_raises_held_out_accuracy_by_ten_points(runs):
    tmp, common = runs
    warm = tmp / "runs" / "sft" / "checkpoints" / "step_80"
    train(write_recipe(tmp, "grpo", "vlm/vlm_grpo-tinyomni-1n0g-torch.yaml", {
        **common, "model.path": str(warm), "grpo.max_steps": 100, "checkpoint.period": 100}))
    val = _val(tmp / "runs" / "grpo")
    print(f"held-out accuracy {val[0]:.3f} -> {' '.join(f'{v:.3f}' for v in val[1:])} (GRPO steps 25-100)")
    assert len(val) == 5, val
    assert mean(val[2:]) >= val[0] + 0.10, val
    assert _max_error(tmp / "runs" / "grpo") < 1.05


@pytest.mark.timeout(2400)
def test_mopd_closes_half_the_gap_to_a_longer_trained_teacher(runs):
    tmp, common = runs
    sft = _val(tmp / "runs" / "sft")  # step 100 alone: the teacher's accuracy
    train(write_recipe(tmp, "mopd", "vlm/vlm_mopd-tinyomni-1n0g-torch.yaml", {
        **common, "model.path": str(tmp / "runs" / "sft" / "checkpoints" / "step_80"), "model.max_seq_len": 512,
        "vision.max_images_per_sample": 1, "env.max_turns": 1, "env.preset": "tiny",
        "data.train": None, "data.eval": None,
        "data.prepare": {"n_train": 4096, "n_eval": 400, "preset": "tiny", "knobs": {"radius": "9"}},
        "generation.max_new_tokens": 8,
        "mopd.prompts_per_step": 16, "mopd.generations_per_prompt": 4, "mopd.max_steps": 100,
        "mopd.val_period": 25, "mopd.val_at_start": True, "mopd.val_prompts": 400, "mopd.top_k": 16,
        # synchronous, unlike the recipe: the logprob check below compares generator and trainer under the same
        # weights, which a one-step lag is not (asynchronous, the same run read 1.08 from the lag alone)
        "mopd.async.enabled": False,
        "mopd.teachers": {"_override_": True, "counting": {"path": str(tmp / "runs" / "sft" / "final")}},
        "mopd.agent_to_teacher": {"_override_": True, "circle_count_simple_agent": "counting"},
        "checkpoint.period": 100}))
    val = _val(tmp / "runs" / "mopd")
    teacher, start = sft[-1], val[0]
    print(f"teacher {teacher:.3f}; student {start:.3f} -> {' '.join(f'{v:.3f}' for v in val[1:])} (MOPD 25-100)")
    assert teacher > start + 0.1, (teacher, start)  # a gap worth closing
    assert mean(val[2:]) - start >= 0.5 * (teacher - start), (teacher, val)
    assert _max_error(tmp / "runs" / "mopd") < 1.05
