"""SFT end to end on a real local Ray with the real tiny LLaVA, and a NaN loss stopping a run cleanly."""

from __future__ import annotations

import json

import pytest
import torch

from gymv.errors import GymvError
from gymv.runs.checkpoint import list_checkpoints, read_state
from gymv.train import Reporter, train
from tiny_models import tiny_path
from train_helpers import (model_weights, ray_module, read_weights, step_timing, timing_keys, tiny_grpo_settings,
                           write_recipe)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def sft_settings(tmp, **extra) -> dict:
    settings = {
        "algorithm": "vlm_sft", "model.path": str(tiny_path("tiny-llava")), "model.max_seq_len": 256,
        "vision": {"max_images_per_sample": 1},
        "env.name": "circle-count", "env.preset": "tiny", "env.max_turns": 1,
        "data.prepare.n_train": 16, "data.prepare.n_eval": 2,
        "generation.max_new_tokens": 8, "training.lr": 1.0e-3,
        "sft.max_steps": 4, "sft.batch_size": 4, "sft.val_period": 2, "sft.val_prompts": 2,
        "checkpoint.dir": str(tmp / "runs"), "checkpoint.period": 1, "checkpoint.keep": 5,
        "cluster.ray_address": None,
    }
    settings.update(extra)
    return settings


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    summary = train(write_recipe(tmp, "sft", "sft.yaml", sft_settings(tmp)))
    return tmp, summary


def test_a_few_sft_steps_lower_the_loss_and_validate_with_rollouts(sft_run):
    tmp_path, summary = sft_run
    rows = _metrics(tmp_path / "runs" / "sft")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    losses = [r["train/loss"] for r in rows]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("val/accuracy" in rows[i] for i in (1, 3)) and "val/accuracy" not in rows[0]
    assert all(r["timing/tokens_per_s"] > 0 for r in rows)
    assert summary["final_dir"] and (tmp_path / "runs" / "sft" / "rollouts" / "val_step_4.jsonl").exists()


def test_every_timing_key_is_a_phase_of_the_steps_timer_validations_refit_included(sft_run):
    tmp_path, _ = sft_run
    rows = _metrics(tmp_path / "runs" / "sft")
    for r in rows:
        validated = r["step"] % 2 == 0  # sft.val_period 2: the generator is refit, then validates
        phases = ("samples", "training", "train_step", *(("refit", "validation") if validated else ()))
        assert timing_keys(r) == step_timing(*phases, rates=("tokens",)), r["step"]
        assert sum(r[f"timing/{p}_s"] for p in phases if p != "train_step") <= r["timing/step_s"]


def test_a_nan_loss_stops_the_run_with_a_clear_error_and_the_last_checkpoint_intact(tmp_path):
    # lr 1e30 sends the weights to ~1e30 in step 1 (still finite, so step 1 is saved); step 2's forward
    # pass overflows, its loss is NaN and the step is refused.
    recipe = write_recipe(tmp_path, "nan", "sft.yaml", sft_settings(tmp_path, **{
        "training.lr": 1.0e30, "training.max_grad_norm": None, "sft.val_period": 0}))
    with pytest.raises(GymvError) as err:
        train(recipe)
    text = str(err.value)
    assert "non-finite" in text and "train step 2" in text and "checkpoints/step_1" in text
    run = tmp_path / "runs" / "nan"
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert read_state(run / "checkpoints" / "step_1").step == 1
    weights = read_weights(run / "checkpoints" / "step_1")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert [r["step"] for r in _metrics(run)] == [1]


class Hashes(Reporter):
    def __init__(self):
        self.refits = []

    def on_refit(self, step, cluster):
        self.refits.append(cluster.weight_hashes())


def test_grpo_warm_starts_from_the_sft_runs_latest_checkpoint(sft_run, tmp_path):
    """SFT -> GRPO: model.path names the SFT run's `checkpoints/latest`; shm refit, KL to the frozen start,
    encoder-cache reset after every refit, and the environment served over HTTP (env.url)."""
    from gymv.envs import get_env
    from gymv.envs.server import EnvServer

    sft_tmp, _ = sft_run
    latest = sft_tmp / "runs" / "sft" / "checkpoints" / "latest"
    with EnvServer(get_env("circle-count")) as server:
        settings = tiny_grpo_settings(tmp_path, latest, **{
            "env.name": "circle-count", "env.preset": "tiny", "env.url": server.url, "grpo.max_steps": 2,
            "training.lr": 1.0e-12, "refit.transport": "shm", "grpo.loss.kl_coef": 0.05,
            "generation.reset_encoder_cache_after_weight_update": True})
        hashes = Hashes()
        train(write_recipe(tmp_path, "grpo", "vlm_grpo.yaml", settings), reporter=hashes)
        verified = server.sessions  # the rollouts were scored by the server
    assert len(verified) > 0
    start = model_weights(sft_tmp / "runs" / "sft" / "checkpoints" / "step_4")
    base = model_weights(tiny_path("tiny-llava"))
    end = model_weights(tmp_path / "runs" / "grpo" / "final")
    assert all(torch.allclose(end[k], start[k], atol=1e-6) for k in start)  # lr 1e-12: GRPO kept the SFT weights
    assert any(not torch.allclose(end[k], base[k], atol=1e-4) for k in base)  # ...which are not the base model's
    rows = _metrics(tmp_path / "runs" / "grpo")
    assert all(r["train/kl_ref"] >= 0 and r["train/token_mult_prob_error"] < 1.05 for r in rows)
    assert [gens == [trainer] for trainer, gens in hashes.refits] == [True, True]
