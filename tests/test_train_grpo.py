"""Synchronous GRPO end to end on a real local Ray with the real tiny LLaVA: rollouts, training, refit."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from gymv.runs.rollout_log import model_calls, read_rollouts
from gymv.train import Reporter, train
from tiny_models import tiny_path
from train_helpers import (ROLLOUT_RATES, model_weights, ray_module, read_weights, step_timing, sync_phases, timing_keys,
                           tiny_grpo_settings, write_recipe)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


class Recorder(Reporter):
    """Compares the generation worker's weights with the trainer's after every refit."""

    def __init__(self):
        self.hashes: list[tuple[int, str, list[str]]] = []
        self.steps: list[int] = []
        self.phases: list[tuple[int, str]] = []

    def on_phase(self, step, name):
        self.phases.append((step, name))

    def on_refit(self, step, cluster):
        trainer, generators = cluster.weight_hashes()
        self.hashes.append((step, trainer, generators))

    def on_step(self, step, metrics):
        self.steps.append(step)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    settings = tiny_grpo_settings(tmp, tiny_path("tiny-llava"), **{"grpo.seq_logprob_error_threshold": 2.0})
    recipe = write_recipe(tmp, "grpo-e2e", "vlm_grpo.yaml", settings)
    rec = Recorder()
    summary = train(recipe, reporter=rec)
    return summary, rec, tmp / "runs" / "grpo-e2e"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_three_steps_log_finite_losses_and_every_phase_timing(grpo_run):
    summary, _, run = grpo_run
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["complete"]
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        for key in ("timing/generation_s", "timing/logprobs_s", "timing/training_s", "timing/refit_s",
                    "timing/step_s", "timing/tokens_per_s", "train/reward_mean", "train/reward_std",
                    "train/accuracy", "train/advantage_mean", "train/clip_fraction", "train/entropy"):
            assert key in r, key


def test_every_timing_key_is_a_phase_of_the_steps_timer_and_lies_within_the_step(grpo_run):
    _, _, run = grpo_run
    for r in _metrics(run):
        assert timing_keys(r) == step_timing(*sync_phases(), rates=ROLLOUT_RATES)
        assert r["timing/env_s"] <= r["timing/generation_s"]  # measured inside the rollout round trip
        assert r["timing/train_step_s"] <= r["timing/training_s"]
        inside = ("generation_s", "logprobs_s", "training_s", "refit_s")  # one after another within the step
        assert sum(r[f"timing/{k}"] for k in inside) <= r["timing/step_s"]


def test_each_step_tells_the_reporter_its_phases_as_they_start(grpo_run):
    _, rec, _ = grpo_run
    for step in (1, 2, 3):
        names = [name for s, name in rec.phases if s == step]
        assert names[:3] == ["generation", "training", "refit"], names
    assert [s for s, _ in rec.phases] == sorted(s for s, _ in rec.phases)


def test_some_group_carries_signal_so_the_weights_change(grpo_run):
    _, _, run = grpo_run
    assert any(r["train/grad_norm"] > 0 for r in _metrics(run))
    start, end = model_weights(tiny_path("tiny-llava")), model_weights(run / "final")
    assert any(not torch.equal(start[k], end[k]) for k in start)


def test_generation_worker_holds_the_trainers_weights_after_every_refit(grpo_run):
    _, rec, _ = grpo_run
    assert [s for s, _, _ in rec.hashes] == [1, 2, 3]
    assert len({t for _, t, _ in rec.hashes}) == 3  # the weights moved every step...
    for _, trainer, generators in rec.hashes:
        assert generators == [trainer]  # ...and the generator got each version exactly


def test_generator_and_trainer_logprobs_agree_on_the_same_tokens(grpo_run):
    _, _, run = grpo_run
    errors = [r["train/token_mult_prob_error"] for r in _metrics(run)]
    assert all(1.0 <= e < 1.05 for e in errors), errors


def test_a_recipe_with_a_sequence_error_threshold_logs_nemo_rls_eight_figures(grpo_run):
    _, _, run = grpo_run
    for r in _metrics(run):
        assert r["train/num_masked_seqs_by_logprob_error"] == 0.0  # one engine, same weights: nothing to mask
        assert 1.0 <= r["train/min_seq_mult_prob_error"] <= r["train/max_seq_mult_prob_error"] < 1.05
        assert r["train/max_seq_mult_prob_error_after_mask"] == r["train/max_seq_mult_prob_error"]
        assert r["train/masked_correct_pct"] == 0.0 and r["train/num_sequences"] == 4


def test_rollouts_are_written_in_nemo_gym_format_with_token_ids_and_logprobs(grpo_run):
    _, _, run = grpo_run
    records = read_rollouts(run / "rollouts" / "step_2.jsonl")
    assert len(records) == 4
    assert sorted(r["_ng_rollout_index"] for r in records) == [0, 0, 1, 1]
    for r in records:
        calls = model_calls(r)
        assert len(calls) == 1 and len(calls[0]["generation_token_ids"]) == len(calls[0]["generation_log_probs"]) > 0
        assert r["reward"] in (0.0, 1.0)


def test_each_rollout_records_the_advantage_it_was_trained_with(grpo_run):
    _, _, run = grpo_run
    for step in (1, 2, 3):
        records = read_rollouts(run / "rollouts" / f"step_{step}.jsonl")
        for task in {r["_ng_task_index"] for r in records}:
            group = [r for r in records if r["_ng_task_index"] == task]
            rewards = [r["reward"] for r in group]
            advantages = [r["_gymv"]["advantage"] for r in group]
            mean = sum(rewards) / len(rewards)
            for reward, adv in zip(rewards, advantages):  # above the group's mean: pushed up; below: down
                assert adv == 0.0 if reward == mean else (adv > 0) == (reward > mean), (rewards, advantages)


def test_final_export_loads_as_a_hugging_face_model_with_the_trainers_last_weights(grpo_run):
    """`final/` may store the checkpoint's own key layout (save_pretrained), so it is compared by loading it:
    every weight the trainer saved at the last step (module names) is in the loaded model, unchanged."""
    from gymv.backends.policy import load_policy

    _, _, run = grpo_run
    loaded = load_policy(run / "final").model.state_dict()
    last = read_weights(run / "checkpoints" / "step_3")  # the trainer's own save, by module name
    assert last and set(last) <= set(loaded)
    different = [k for k, v in last.items() if not torch.equal(v, loaded[k])]
    assert different == []


def test_two_generation_workers_split_each_batch_and_both_hold_the_trainers_weights(tmp_path):
    class Workers(Recorder):
        def on_refit(self, step, cluster):
            super().on_refit(step, cluster)
            self.generated = [s["episodes"] for s in cluster.generation_stats()]

    recipe = write_recipe(tmp_path, "two-gen", "vlm_grpo.yaml",
                          tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"cluster.generation_workers_per_gpu": 2}))
    rec = Workers()
    assert train(recipe, reporter=rec)["complete"]
    assert [s for s, _, _ in rec.hashes] == [1, 2, 3]
    for _, trainer, generators in rec.hashes:
        assert generators == [trainer, trainer]
    assert len(rec.generated) == 2 and all(n > 0 for n in rec.generated)  # each worker took its share


def test_a_cosine_schedule_ends_the_run_at_its_floor(tmp_path):
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{
        "training.lr_schedule": "cosine", "training.min_lr_ratio": 0.1, "checkpoint.period": 10})
    train(write_recipe(tmp_path, "cosine", "vlm_grpo.yaml", settings))
    lrs = [r["train/lr"] for r in _metrics(tmp_path / "runs" / "cosine")]
    assert lrs == pytest.approx([1e-3, 0.55e-3, 0.1e-3])  # steps 1, 2, 3 of 3


class Messages(Recorder):
    def __init__(self):
        super().__init__()
        self.messages = []

    def on_message(self, text):
        self.messages.append(text)


def test_a_run_with_checkpoints_off_writes_none_says_so_and_still_exports_the_final_model(tmp_path):
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"checkpoint.enabled": False,
                                                                         "checkpoint.period": 1})
    rec = Messages()
    summary = train(write_recipe(tmp_path, "no-ckpt", "vlm_grpo.yaml", settings), reporter=rec)
    run = tmp_path / "runs" / "no-ckpt"
    assert summary["complete"] and rec.steps == [1, 2, 3]
    assert not list(run.glob("checkpoints/step_*"))
    assert any("checkpoint.enabled: false" in m for m in rec.messages)
    assert (run / "final" / "config.json").exists()


def test_a_checkpoint_disk_too_small_is_told_at_the_launch_and_the_run_stops_at_its_first_checkpoint(
        tmp_path, tmpfs, monkeypatch):
    from gymv.errors import GymvError
    from gymv.train.loop import Checkpointer

    disk = tmpfs("6m")  # the tiny LLaVA's checkpoint is about 9 MB
    monkeypatch.setattr(Checkpointer, "retry_wait_s", 0.0)
    settings = tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"checkpoint.dir": str(disk)})
    rec = Messages()
    with pytest.raises(GymvError, match="could not be written, twice: .*No space left on device"):
        train(write_recipe(tmp_path, "small-disk", "vlm_grpo.yaml", settings), reporter=rec)
    warned = [m for m in rec.messages if "the next checkpoint will not be written" in m]
    assert warned and warned[0].startswith("warning: a checkpoint of this run takes about 9.")
    assert rec.steps == [1]  # told before step 1, stopped at its checkpoint


class KillTrainer(Recorder):
    """Kills the training worker's process at one refit (a crash, an OOM kill), once."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.killed, self.messages = at, None, []

    def on_refit(self, step, cluster):
        import signal

        import ray

        if step == self.at and self.killed is None:
            self.killed = ray.get(cluster.trainers[0].where.remote())["pid"]
            os.kill(self.killed, signal.SIGKILL)

    def on_message(self, text):
        self.messages.append(text)


def test_a_killed_training_worker_is_named_and_max_restarts_resumes_the_run_from_its_checkpoint(tmp_path):
    recipe = write_recipe(tmp_path, "killed", "vlm_grpo.yaml",
                          tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **{"grpo.max_steps": 2}))
    killer = KillTrainer(at=2)
    summary = train(recipe, reporter=killer, max_restarts=1)
    restart = next(m for m in killer.messages if m.startswith("restart 1/1 after: "))
    assert "training rank 0 on node 127.0.0.1" in restart and "its process ended" in restart, restart
    assert "out of memory" not in restart and "checkpoints/step_1" in restart
    assert summary["complete"] and [r["step"] for r in _metrics(tmp_path / "runs" / "killed")] == [1, 2]
    placed = json.loads((tmp_path / "runs" / "killed" / "placement.json").read_text())
    assert placed["refit_transport"] == "object_store" and len(placed["roles"]["training"]["workers"]) == 1

