"""What `gymv train` shows while it runs: on a terminal a spinner through the silent start (Ray, workers), then
a progress bar; in a log, one plain line per step."""

from __future__ import annotations

import io

from rich.console import Console

import gymv_cli.output as output


def _display(monkeypatch, live: bool):
    import gymv_cli.commands.train as train_cmd

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=live, width=120, color_system=None)
    monkeypatch.setattr(output, "err_console", console)
    monkeypatch.setattr(train_cmd, "err_console", console)
    return train_cmd._display(live=live), buf


def test_a_terminal_shows_a_spinner_from_ray_start_until_training_starts(monkeypatch):
    display, _ = _display(monkeypatch, live=True)
    display.on_message("starting a local Ray cluster")
    assert display.status is not None
    display.on_message("starting workers")
    assert display.status is not None
    display.on_start({"algorithm": "vlm_grpo", "start_step": 0, "max_steps": 3})
    assert display.status is None and display.task is not None
    display.stop()


def test_a_log_gets_one_plain_line_per_step(monkeypatch, capsys):
    display, _ = _display(monkeypatch, live=False)
    display.on_message("starting a local Ray cluster")
    display.on_start({"algorithm": "vlm_grpo", "start_step": 0, "max_steps": 3, "run_dir": "runs/x"})
    display.on_step(1, {"train/reward_mean": 0.25, "train/loss": 0.5, "timing/step_s": 1.5})
    display.stop()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "starting a local Ray cluster"
    assert lines[1] == "vlm_grpo: steps 1..3 (run directory runs/x)"
    assert lines[2].startswith("step 1/3 | reward 0.25 | loss 0.5 | step s 1.5 | elapsed 0:00:")


def test_a_terminal_bar_names_the_phase_under_way(monkeypatch):
    display, _ = _display(monkeypatch, live=True)
    display.on_start({"algorithm": "vlm_grpo", "start_step": 0, "max_steps": 3})
    display.on_phase(1, "training")
    assert display.bar.tasks[0].fields["info"] == "step 1: training ..."
    display.stop()


def test_a_log_tells_the_phases_of_long_steps_only(monkeypatch, capsys):
    import gymv_cli.commands.train as train_cmd

    display, _ = _display(monkeypatch, live=False)
    display.on_start({"algorithm": "vlm_grpo", "start_step": 0, "max_steps": 3, "run_dir": "runs/x"})
    display.on_phase(1, "generation")
    display.on_step(1, {"timing/step_s": 1.5})
    display.on_phase(2, "generation")  # the step before was short: nothing
    display.on_step(2, {"timing/step_s": train_cmd.LONG_STEP_S + 1})
    display.on_phase(3, "generation")  # the step before was long
    display.stop()
    told = [line for line in capsys.readouterr().err.splitlines() if ": generation (" in line]
    assert told == ["step 3: generation (0:00:00 into the step)"]


def test_a_log_tells_a_phase_that_starts_after_the_step_has_run_long(monkeypatch, capsys):
    import time

    clock = iter([0.0, 100.0, 145.0])  # the display's start, then each phase's start
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    display, _ = _display(monkeypatch, live=False)
    display.on_start({"algorithm": "vlm_grpo", "start_step": 0, "max_steps": 3, "run_dir": "runs/x"})
    display.on_phase(1, "generation")
    display.on_phase(1, "training")
    display.stop()
    assert capsys.readouterr().err.splitlines()[-1] == "step 1: training (0:00:45 into the step)"
