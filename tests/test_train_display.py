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
