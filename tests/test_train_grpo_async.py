"""Async GRPO end to end on a real local Ray with the real tiny LLaVA: generation ahead of training,
the staleness bound, importance sampling, encoder-cache resets, a generation worker killed mid-run."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from gymv.errors import GymvError
from gymv.train import Reporter, train
from tiny_models import tiny_path
from train_helpers import ROLLOUT_RATES, ray_module, step_timing, timing_keys, tiny_grpo_settings, write_recipe

pytestmark = pytest.mark.slow

ASYNC = {"grpo.async.enabled": True, "grpo.importance_sampling.kind": "truncated"}


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def run_recipe(tmp, name, reporter=None, **settings):
    recipe = write_recipe(tmp, name, "vlm_grpo.yaml", tiny_grpo_settings(tmp, tiny_path("tiny-llava"), **settings))
    summary = train(recipe, reporter=reporter)
    run = tmp / "runs" / name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return summary, run, rows


def records(run, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_off(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_off")
    return run_recipe(tmp, "one-off", **ASYNC, **{"grpo.max_steps": 4, "grpo.seq_logprob_error_threshold": 2.0})


def test_age_zero_async_reproduces_the_synchronous_run_sample_for_sample(tmp_path):
    same = {"grpo.importance_sampling.kind": "truncated", "grpo.max_steps": 3}
    _, sync_run, sync_rows = run_recipe(tmp_path, "sync", **same)
    _, async_run, async_rows = run_recipe(tmp_path, "async0", **same, **{"grpo.async.enabled": True,
                                                                         "grpo.async.max_trajectory_age_steps": 0})
    for a, b in zip(sync_rows, async_rows):
        assert a["step"] == b["step"]
        for key in ("train/loss", "train/reward_mean", "train/pg_loss", "train/grad_norm", "train/token_mult_prob_error"):
            assert a[key] == b[key], (a["step"], key)
        assert b["async/age_max"] == 0.0
    for step in (1, 2, 3):
        a, b = records(sync_run, step), records(async_run, step)
        assert [_tokens(r) for r in a] == [_tokens(r) for r in b] and len(a) == 4
        assert [r["reward"] for r in a] == [r["reward"] for r in b]


def _tokens(record) -> list:
    """Every token id list inside a rollout record (wherever the format keeps them)."""
    out = []
    if isinstance(record, dict):
        for k, v in record.items():
            if k.endswith("token_ids"):
                out.append(v)
            else:
                out.extend(_tokens(v))
    elif isinstance(record, list):
        for v in record:
            out.extend(_tokens(v))
    return out


def test_one_off_async_trains_each_step_on_weights_one_step_old(one_off):
    summary, _, rows = one_off
    assert summary["complete"] and [r["step"] for r in rows] == [1, 2, 3, 4]


def test_one_off_async_judges_each_sequence_against_the_trainers_weights_before_the_step(one_off):
    _, _, rows = one_off
    for r in rows:  # behaviour from weights up to a step old: each sequence's error is measured, >= 1
        assert 1.0 <= r["train/min_seq_mult_prob_error"] <= r["train/max_seq_mult_prob_error"]
        assert r["train/num_sequences"] == 4 - r["train/num_masked_seqs_by_logprob_error"]
    assert rows[0]["async/age_max"] == 0.0  # step 1 trains on the initial weights, which are current
    for r in rows[1:]:
        assert r["async/age_1_fraction"] == 1.0 and r["async/age_max"] == 1.0
        assert r["async/dropped_trajectories"] == 0.0


def test_rollout_records_carry_the_weights_version_that_generated_them(one_off):
    _, run, _ = one_off
    for step in (1, 2, 3, 4):
        assert {r["_gymv"]["weights_version"] for r in records(run, step)} == {max(step - 2, 0)}


def test_truncated_importance_weights_are_logged_and_capped(one_off):
    _, _, rows = one_off
    for r in rows:
        assert math.isfinite(r["train/is_weight_mean"]) and 0.0 < r["train/is_weight_max"] <= 2.0
        assert math.isfinite(r["train/loss"])


def test_every_async_metric_is_logged_every_step(one_off):
    _, _, rows = one_off
    for r in rows:
        for key in ("async/overlap_fraction", "timing/overlap_s", "timing/wait_s", "async/age_mean",
                    "async/age_0_fraction", "async/age_1_fraction", "async/dropped_trajectories_total",
                    "async/buffered_groups", "async/encoder_cache_stale_hits_total", "timing/step_s"):
            assert math.isfinite(r[key]), key
        assert 0.0 <= r["async/overlap_fraction"] <= 1.0


def test_every_async_timing_key_is_a_phase_of_the_steps_timer(one_off):
    _, _, rows = one_off
    phases = ("wait", "generation", "env", "overlap", "logprobs", "training", "train_step", "refit")
    for r in rows:
        assert timing_keys(r) == step_timing(*phases, rates=ROLLOUT_RATES)
        # back to back: a step's clock runs from the step before's end, so its waits are inside it
        assert r["timing/wait_s"] + r["timing/logprobs_s"] + r["timing/training_s"] + r["timing/refit_s"] <= r["timing/step_s"]


def test_with_the_encoder_cache_reset_no_rollout_uses_features_of_older_weights(tmp_path):
    # 8 rows, 2 prompts a step: the same images come back every 4 steps, after several refits
    _, _, rows = run_recipe(tmp_path, "reset", **ASYNC, **{"grpo.max_steps": 6,
                                                           "generation.reset_encoder_cache_after_weight_update": True})
    assert rows[-1]["async/encoder_cache_stale_hits_total"] == 0.0


def test_without_the_encoder_cache_reset_stale_features_are_reused_and_counted(tmp_path):
    _, _, rows = run_recipe(tmp_path, "no-reset", **ASYNC, **{"grpo.max_steps": 6,
                                                              "generation.reset_encoder_cache_after_weight_update": False})
    assert rows[-1]["async/encoder_cache_stale_hits_total"] > 0.0


class KillGenerator(Reporter):
    """SIGKILLs the generation worker's process right after the refit of step `at`."""

    def __init__(self, at: int):
        self.at, self.killed = at, None

    def on_refit(self, step, cluster):
        import ray

        if step == self.at:
            self.killed = ray.get(cluster.generators[0].pid.remote())
            os.kill(self.killed, signal.SIGKILL)


def test_a_generation_worker_killed_mid_run_is_replaced_and_the_run_finishes(tmp_path):
    killer = KillGenerator(at=2)
    summary, run, rows = run_recipe(tmp_path, "killed", reporter=killer, **ASYNC, **{"grpo.max_steps": 5})
    assert killer.killed is not None
    assert summary["complete"] and [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["async/worker_restarts_total"] >= 1.0
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert (run / "final" / "config.json").exists()


def test_an_async_run_stopped_and_resumed_logs_every_step_once(tmp_path):
    settings = {**ASYNC, "grpo.max_steps": 4, "checkpoint.steps_per_run": 2}
    first, run, _ = run_recipe(tmp_path, "resumed", **settings)
    assert first["step"] == 2 and not first["complete"]
    second, _, rows = run_recipe(tmp_path, "resumed", **settings)
    assert second["complete"] and [r["step"] for r in rows] == [1, 2, 3, 4]


def test_async_on_an_sft_recipe_is_refused_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path, "sft", "sft.yaml", {"model.path": str(tiny_path("tiny-llava"))})
    with pytest.raises(GymvError, match="--async runs GRPO"):
        train(recipe, async_grpo=True)


def test_async_without_importance_sampling_is_refused_naming_the_key(tmp_path):
    recipe = write_recipe(tmp_path, "no-is", "vlm_grpo.yaml", tiny_grpo_settings(tmp_path, tiny_path("tiny-llava")))
    with pytest.raises(GymvError) as e:
        train(recipe, async_grpo=True)
    assert "importance_sampling" in str(e.value)
