"""runs/<name>/: config.yaml, refusing to clobber a run, and resume = restore + rewind of the logs."""

import pytest
import torch
import yaml

from gymv.algorithms.loss_fns import SFTLoss
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.runs.checkpoint import DataPosition
from gymv.runs.rollout_log import make_rollout_record, rollout_files
from gymv.runs.run_dir import RunDir, run_path
from gymv.sections import TrainingSection
from tiny_lm import logprob_fn, make_samples, tiny_lm

CONFIG = {"algorithm": "grpo", "grpo": {"num_generations": 4}, "trainer": {"lr": 1e-2}}


def record():
    return make_rollout_record({"responses_create_params": {"input": []}}, [{"type": "message", "role": "assistant", "content": []}], 0.0)


def test_create_writes_the_resolved_config_as_yaml(tmp_path):
    run = RunDir.create(run_path(tmp_path / "runs", "demo"), CONFIG)
    assert yaml.safe_load((tmp_path / "runs" / "demo" / "config.yaml").read_text()) == CONFIG
    assert run.read_config() == CONFIG


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path):
    RunDir.create(tmp_path / "demo", CONFIG)
    with pytest.raises(GymvError, match="already exists"):
        RunDir.create(tmp_path / "demo", CONFIG)
    RunDir.create(tmp_path / "demo", {**CONFIG, "max_steps": 9}, resume=True)
    assert RunDir(tmp_path / "demo").read_config()["max_steps"] == 9


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden"])
def test_run_names_that_escape_or_hide_are_refused(tmp_path, name):
    with pytest.raises(GymvError, match="invalid run name"):
        run_path(tmp_path, name)


def test_resume_restores_the_checkpoint_and_drops_later_logs(tmp_path):
    run = RunDir.create(tmp_path / "demo", CONFIG)
    t = TorchTrainer(tiny_lm(0), logprob_fn, TrainingSection(lr=1e-2))
    with run.metrics_log() as log:
        for step in (1, 2, 3):
            log.log(step, t.train_step(make_samples(2, seed=step), SFTLoss()))
            run.write_rollouts(step, [record()])
            if step == 2:
                run.checkpoints().save(step, t, DataPosition(index=2 * step))
    fresh = TorchTrainer(tiny_lm(1), logprob_fn, TrainingSection(lr=1e-2))
    state = RunDir.create(tmp_path / "demo", CONFIG, resume=True).resume(fresh)
    assert state.step == 2 and fresh.steps == 2
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    assert [s for s, _ in rollout_files(run.path)] == [1, 2]


def test_resume_without_a_checkpoint_starts_over(tmp_path):
    run = RunDir.create(tmp_path / "demo", CONFIG)
    with run.metrics_log() as log:
        log.log(0, {"val/reward_mean": 0.1})
    assert run.resume(TorchTrainer(tiny_lm(0), logprob_fn)) is None
    assert run.read_metrics() == []


def test_a_config_that_is_not_plain_data_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="not plain data"):
        RunDir.create(tmp_path / "demo", {"x": torch.zeros(1)})


def _run_with_checkpoint(tmp_path, step=2):
    run = RunDir.create(tmp_path / "demo", CONFIG)
    t = TorchTrainer(tiny_lm(0), logprob_fn, TrainingSection(lr=1e-2))
    with run.metrics_log() as log:
        for s in range(1, step + 1):
            log.log(s, t.train_step(make_samples(2, seed=s), SFTLoss()))
            run.write_rollouts(s, [record()])
    run.checkpoints().save(step, t, DataPosition(index=2 * step))
    return run


def test_resume_when_no_checkpoint_reads_is_an_error_that_keeps_everything(tmp_path):
    run = _run_with_checkpoint(tmp_path)
    state = run.checkpoints_dir / "step_2" / "state.json"
    state.write_text(state.read_text()[:10])  # torn
    weights = (run.checkpoints_dir / "step_2" / "model.safetensors").read_bytes()
    with pytest.raises(GymvError, match=r"no usable checkpoint to resume from \(step_2: unreadable state.json"):
        run.resume(TorchTrainer(tiny_lm(1), logprob_fn))
    assert [r["step"] for r in run.read_metrics()] == [1, 2]  # nothing rewound
    assert [s for s, _ in rollout_files(run.path)] == [1, 2]
    assert (run.checkpoints_dir / "step_2" / "model.safetensors").read_bytes() == weights


def test_a_truncated_weights_file_makes_a_checkpoint_incomplete(tmp_path):
    run = _run_with_checkpoint(tmp_path)
    weights = run.checkpoints_dir / "step_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert run.checkpoints().latest() is None
    with pytest.raises(GymvError, match="step_2: model.safetensors is .* bytes, its header says"):
        run.resume(TorchTrainer(tiny_lm(1), logprob_fn))


def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_previous_one_kept(tmp_path):
    run = _run_with_checkpoint(tmp_path)
    t = TorchTrainer(tiny_lm(0), logprob_fn, TrainingSection(lr=1e-2))
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("inf"))
    with pytest.raises(GymvError, match="after step 3 hold non-finite values .* training diverged"):
        run.checkpoints().save(3, t, DataPosition(index=6))
    assert run.checkpoints().latest().name == "step_2"
    assert not any(p.name.startswith(".tmp-") for p in run.checkpoints_dir.iterdir())


def test_resuming_never_rewrites_config_yaml_and_records_what_changed(tmp_path):
    RunDir.create(tmp_path / "demo", CONFIG)
    original = (tmp_path / "demo" / "config.yaml").read_text()
    run = RunDir.create(tmp_path / "demo", {**CONFIG, "trainer": {"lr": 1e-3}}, resume=True)
    assert (tmp_path / "demo" / "config.yaml").read_text() == original
    assert run.changes == [("trainer.lr", 1e-2, 1e-3)]
    assert run.read_original_config() == CONFIG and run.read_config()["trainer"]["lr"] == 1e-3
    again = RunDir.create(tmp_path / "demo", {**CONFIG, "trainer": {"lr": 1e-3}}, resume=True)
    assert again.changes == []  # the current config already says so: nothing new to record


def test_a_recipe_onto_a_trained_run_with_another_config_is_refused_but_an_untrained_one_is_not(tmp_path):
    from gymv.train.setup import _has_trained, refuse_changed_config

    run = RunDir.create(tmp_path / "demo", CONFIG)
    assert not _has_trained(run)
    with run.metrics_log() as log:
        log.log(1, {"train/loss": 1.0})
    assert _has_trained(run)
    with pytest.raises(GymvError, match=r"holds a run with another config: trainer.lr 0.01 -> 0.5"):
        refuse_changed_config(run, {**CONFIG, "trainer": {"lr": 0.5}})
    refuse_changed_config(run, {**CONFIG, "checkpoint": {"steps_per_run": 2}})  # how a launch runs: allowed
