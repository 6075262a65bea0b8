"""TensorBoard and W&B behind one logger interface, fed by metrics.jsonl (the source of truth)."""

from __future__ import annotations

import sys

import pytest

from gymv.config.validate import validate_config
from gymv.errors import GymvError
from gymv.loggers import MetricsLogger, build_loggers, logger_classes, register_logger
from gymv.runs.run_dir import RunDir


def _cfg(**logger):
    return validate_config({"algorithm": "sft", "name": "run", "logger": logger})


def _run(tmp_path, cfg, name="run"):
    run = RunDir.create(tmp_path / name, cfg.to_dict(), resume=True)
    run.loggers = build_loggers(cfg, cfg.to_dict(), run.path)
    return run


def _tb_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_holds_the_same_scalars_as_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    run = _run(tmp_path, _cfg(tensorboard=True))
    with run.metrics_log() as log:
        for step in (1, 2, 3):
            log.log(step, {"train/loss": 1.0 / step, "train/reward_mean": 0.25 * step, "note": "text is skipped"})
    rows = run.read_metrics()
    got = _tb_scalars(run.path / "tensorboard", "train/loss")
    assert [s for s, _ in got] == [r["step"] for r in rows]
    assert [v for _, v in got] == pytest.approx([r["train/loss"] for r in rows])
    assert [s for s, _ in _tb_scalars(run.path / "tensorboard", "train/reward_mean")] == [1, 2, 3]


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = _cfg(tensorboard=True)
    run = _run(tmp_path, cfg)
    with run.metrics_log() as log:
        for step in (1, 2, 3):
            log.log(step, {"train/loss": float(step)})
    run.rewind(1)  # the newest checkpoint was step 1: steps 2 and 3 run again
    run = _run(tmp_path, cfg)
    with run.metrics_log() as log:
        for step in (2, 3, 4):
            log.log(step, {"train/loss": 10.0 * step})
    assert _tb_scalars(run.path / "tensorboard", "train/loss") == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


@pytest.mark.slow  # starts W&B's own service process
def test_wandb_offline_logs_into_the_run_directory_and_a_resume_keeps_the_run_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")  # a loaded 2-core machine starts the service slowly
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "300")
    cfg = _cfg(wandb=True, wandb_project="gymv-test")
    run = _run(tmp_path, cfg)
    with run.metrics_log() as log:
        log.log(1, {"train/loss": 0.5})
    run_id = (run.path / "wandb_id").read_text().strip()
    offline = list((run.path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    record_log = next(offline[0].glob("*.wandb")).read_bytes()  # history rows are stored as JSON text
    assert b"train/loss" in record_log and b"gymv-test" in record_log
    run = _run(tmp_path, cfg)
    with run.metrics_log() as log:
        log.log(2, {"train/loss": 0.25})
    assert (run.path / "wandb_id").read_text().strip() == run_id
    assert len(list((run.path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


@pytest.mark.parametrize("name, package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_missing_logger_library_is_one_line_that_says_how_to_install(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees when the package is not installed
    with pytest.raises(GymvError) as e:
        logger_classes(_cfg(**{name: True}))
    assert e.value.where == f"logger.{name}"
    assert f"pip install {package}" in e.value.fix and "gymv[loggers]" in e.value.fix


class _Collect(MetricsLogger):
    name = "collect"
    seen: list = []

    def log(self, step, metrics):
        type(self).seen.append((step, metrics["train/loss"]))


class _Broken(MetricsLogger):
    name = "broken"

    def log(self, step, metrics):
        raise ConnectionError("no route to host")


def test_a_plugin_logger_named_in_logger_plugins_receives_every_row(tmp_path):
    register_logger("collect", _Collect)
    _Collect.seen = []
    run = _run(tmp_path, _cfg(plugins=["collect"]))
    with run.metrics_log() as log:
        log.log(1, {"train/loss": 2.0})
        log.log(2, {"train/loss": 1.0})
    assert _Collect.seen == [(1, 2.0), (2, 1.0)]


def test_an_unknown_plugin_logger_is_refused(tmp_path):
    with pytest.raises(GymvError, match="unknown logger 'nope'"):
        logger_classes(_cfg(plugins=["nope"]))


def test_a_failing_logger_is_switched_off_with_one_warning_and_metrics_jsonl_keeps_every_row(tmp_path, capsys):
    register_logger("broken", _Broken)
    run = _run(tmp_path, _cfg(plugins=["broken"]))
    with run.metrics_log() as log:
        for step in (1, 2, 3):
            log.log(step, {"train/loss": float(step)})
    err = capsys.readouterr().err
    assert err.count("warning: logger broken failed at step 1") == 1 and "ConnectionError" in err
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]


def test_a_logger_of_the_gymv_loggers_entry_point_group_is_found_through_the_shared_registry(tmp_path):
    from gymv.loggers import LOGGERS
    from train_helpers import plugin_on_path

    with plugin_on_path():
        assert LOGGERS.available()["listing"] == "gymv_registry_plugins:ListingLogger"
        run = _run(tmp_path, _cfg(plugins=["listing"]))
        with run.metrics_log() as log:
            log.log(1, {"train/loss": 0.5})
        assert type(run.loggers[0]).rows == [(1, {"train/loss": 0.5})]
