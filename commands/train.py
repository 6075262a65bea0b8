"""`gymv train RECIPE`: run SFT, GRPO or MOPD from a recipe, with progress on stderr and a summary at the end."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json, table

_HELP = """Train a policy with the algorithm of RECIPE: SFT, GRPO or MOPD (text or vlm_).

Writes runs/<name>/: config.yaml, metrics.jsonl, rollouts/, checkpoints/ and, when done, final/ (a Hugging
Face folder). A run directory that already holds checkpoints is continued exactly where it stopped
(checkpoint.resume, default true) when the recipe's config is the run's own; a changed config is refused
with the difference (continue with --resume DIR, whose overrides are recorded in config_changes.jsonl, or
pick a new name=). config.yaml is never rewritten. Overrides KEY=VALUE follow the recipe (docs/config.md).

On a terminal: a progress bar that names the phase under way; piped or redirected (a SLURM log): one plain
line per step on stderr, and a line as each phase starts once a step runs 30 s or more.

Examples:

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml

  gymv train recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml sft.max_steps=20 name=sft-warm

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml model.path=runs/sft-warm/final

  gymv train --resume runs/vlm_grpo-tinyllava-1n0g-torch grpo.max_steps=80

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-async-1off.yaml     (or: RECIPE --async)

  gymv train --ray-address 10.0.0.5:6379 --max-restarts 3 recipes/llm/grpo-qwen3-8b-2n8g-megatron-tp2.yaml

Before Ray starts (or right after joining --ray-address), the recipe's nodes, GPUs and role placement are
checked against the machine or the cluster; where each worker landed is printed and written to
placement.json (docs/cluster.md).
"""


def _row_text(step: int, m: dict) -> str:
    parts = []
    for key, label in (("train/reward_mean", "reward"), ("train/accuracy", "acc"), ("train/loss", "loss"),
                       ("val/accuracy", "val acc"), ("timing/step_s", "step s")):
        v = m.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{label} {v:.3g}")
    return "  ".join(parts)


def _step_line(step: int, total: int, metrics: dict, seconds: float) -> str:
    """One plain line per step for logs (a pipe, a file, a SLURM job): grep-able, no control characters."""
    text = _row_text(step, metrics).replace("  ", " | ")
    return f"step {step}/{total} | {text} | elapsed {_clock(seconds)}" if text else f"step {step}/{total} | elapsed {_clock(seconds)}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


LONG_STEP_S = 30.0  # in a log, the phases of a step are told once it (or the step before) runs this long


def _display(live: bool | None = None):
    """Rich progress (and a spinner while Ray and the workers start) on a terminal; plain lines otherwise.
    Everything goes to stderr, so stdout stays clean for --json."""
    import sys
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from gymv.train import Reporter

    live = err_console.is_terminal if live is None else live

    class Display(Reporter):
        def __init__(self) -> None:
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                console=err_console)
            self.task = None
            self.warned = False
            self.status = None
            self.run_dir = None
            self.step = None
            self.total = None
            self.t0 = time.monotonic()
            self.step_started = None  # (step, when its first phase started)
            self.last_step_s = 0.0

        def _say(self, text: str, style: str = "dim") -> None:
            if not live:
                print(text, file=sys.stderr, flush=True)
            elif self.task is not None:
                self.bar.console.print(f"[{style}]{text}[/{style}]", highlight=False)
            else:
                err_console.print(f"[{style}]{text}[/{style}]", highlight=False)

        def on_run(self, run_dir) -> None:
            self.run_dir = run_dir

        def on_message(self, text: str) -> None:
            if live and self.task is None and text.startswith(("starting", "joining")):
                if self.status is None:  # the silent part of a launch: Ray, then the workers
                    self.status = err_console.status(text + " ...")
                    self.status.start()
                else:
                    self.status.update(text + " ...")
                return
            self._say(text)

        def _stop_status(self) -> None:
            if self.status is not None:
                self.status.stop()
                self.status = None

        def on_start(self, info: dict) -> None:
            self._stop_status()
            if info.get("resumed_from"):
                self._say(f"resuming from {info['resumed_from']}")
            self.step, self.total = info["start_step"], info["max_steps"]
            if live:
                self.task = self.bar.add_task(info["algorithm"], total=info["max_steps"], completed=info["start_step"], info="")
                self.bar.start()
            else:
                self._say(f"{info['algorithm']}: steps {info['start_step'] + 1}..{info['max_steps']} "
                          f"(run directory {info.get('run_dir', self.run_dir)})")

        def on_step(self, step: int, metrics: dict) -> None:
            if self.total is None:
                return
            self.step = step
            self.last_step_s = float(metrics.get("timing/step_s", 0.0))
            if "val/accuracy" in metrics:
                self._say(f"step {step}: val accuracy {metrics['val/accuracy']:.3f}  "
                          f"reward {metrics.get('val/reward_mean', float('nan')):.3f}", style="default")
            if live:
                self.bar.update(self.task, completed=step, info=_row_text(step, metrics))
            elif step > 0:
                self._say(_step_line(step, self.total, metrics, time.monotonic() - self.t0))
            err = metrics.get("train/token_mult_prob_error")
            if "async/age_mean" in metrics and metrics["async/age_mean"] > 0:
                err = None  # async: the trainer is ahead of the weights that sampled, by design (docs/async.md)
            if isinstance(err, float) and err > 1.05 and not self.warned:
                self.warned = True
                self._say(f"step {step}: token_mult_prob_error {err:.3f} > 1.05: the generator's "
                          "logprobs disagree with the trainer's (stale encoder cache? refit dtype?)", style="yellow")

        def on_phase(self, step: int, name: str) -> None:
            """A terminal's bar says what the step is doing; a log says it once a step is long (LONG_STEP_S),
            so a step of minutes is not minutes of silence."""
            now = time.monotonic()
            if self.step_started is None or self.step_started[0] != step:
                self.step_started = (step, now)
            if live:
                if self.task is not None:
                    self.bar.update(self.task, info=f"step {step}: {name} ...")
                return
            into = now - self.step_started[1]
            if max(into, self.last_step_s) >= LONG_STEP_S:
                self._say(f"step {step}: {name} ({_clock(into)} into the step)")

        def on_checkpoint(self, step: int, path) -> None:
            self._say(f"checkpoint {path}")

        def stop(self) -> None:
            self._stop_status()
            if self.task is not None:
                self.bar.stop()

    return Display()


def _interrupted_hint(run_dir) -> str:
    """What Ctrl-C leaves behind and the one command that continues it."""
    from gymv.runs.checkpoint import find_latest

    if run_dir is None:
        return "interrupted before the run directory was written; nothing to resume"
    shown = Path(run_dir)
    try:
        shown = shown.relative_to(Path.cwd())
    except ValueError:
        pass
    latest = find_latest(run_dir)
    where = f"its newest checkpoint is {latest.name}" if latest else "it has no checkpoint yet (it starts over)"
    return f"interrupted; {where}; continue with: gymv train --resume {shown}"


def _summary_rows(summary: dict) -> list[tuple[str, str]]:
    rows = []
    for k, v in summary.items():
        if v is None:
            continue
        rows.append((k, f"{v:.4g}" if isinstance(v, float) else str(v)))
    return rows


def train(
    recipe: str = typer.Argument(None, help="Recipe YAML (optional with --resume: the run's own config.yaml)."),
    overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Overrides KEY=VALUE, +KEY=VALUE, ~KEY.", show_default=False),
    resume: Path = typer.Option(None, "--resume", help="Continue this run directory from its newest checkpoint, with its recorded config (overrides given are recorded in config_changes.jsonl)."),
    ray_address: str = typer.Option(None, "--ray-address", help="Join this Ray cluster (HOST:PORT or auto) instead of starting one."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout instead of the table."),
    async_grpo: bool = typer.Option(False, "--async", help="GRPO or MOPD with generation running ahead of training "
                                    "(grpo.async.enabled or mopd.async.enabled; needs importance_sampling)."),
    max_restarts: int = typer.Option(None, "--max-restarts", min=0, max=100, help="After a lost node or worker, resume from "
                                     "the newest complete checkpoint, at most N times, 0 to 100 (cluster.max_restarts). A "
                                     "worker whose start fails (its constructor raised) is not restarted."),
) -> None:
    from gymv.train import train as run_training

    from gymv.config.overrides import looks_like_override

    overrides = list(overrides or [])
    if recipe is not None and resume is not None and looks_like_override(recipe) and not Path(recipe).exists():
        overrides.insert(0, recipe)  # `gymv train --resume DIR a.b=c` (or `~a.b`): no recipe, only overrides
        recipe = None
    display = _display()
    try:
        summary = run_training(recipe, overrides, resume_dir=str(resume) if resume else None,
                               ray_address=ray_address, reporter=display, async_grpo=async_grpo,
                               max_restarts=max_restarts)
    except KeyboardInterrupt:
        display.stop()
        err_console.print(_interrupted_hint(display.run_dir), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    finally:
        display.stop()
    if json_out:
        print_json(summary)
    else:
        console.print(table(f"gymv train: {summary['run_dir']}", ["", "value"], _summary_rows(summary),
                            justify_numbers=False))


train.__doc__ = _HELP
