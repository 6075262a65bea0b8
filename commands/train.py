"""`gymv train RECIPE`: run SFT, GRPO or MOPD from a recipe, with progress on stderr and a summary at the end."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json, table

_HELP = """Train a policy with the algorithm of RECIPE: SFT, GRPO or MOPD (text or vlm_).

Writes runs/<name>/: config.yaml, metrics.jsonl, rollouts/, checkpoints/ and, when done, final/ (a Hugging
Face folder). A run directory that already holds checkpoints is continued exactly where it stopped
(checkpoint.resume, default true). Overrides KEY=VALUE follow the recipe (see docs/config.md).

Examples:

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml

  gymv train recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml sft.max_steps=20 name=sft-warm

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml model.path=runs/sft-warm/final

  gymv train --resume runs/vlm_grpo-tinyllava-1n0g-torch grpo.max_steps=80

  gymv train recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-async-1off.yaml     (or: RECIPE --async)
"""


def _row_text(step: int, m: dict) -> str:
    parts = []
    for key, label in (("train/reward_mean", "reward"), ("train/accuracy", "acc"), ("train/loss", "loss"),
                       ("val/accuracy", "val acc"), ("timing/step_s", "step s")):
        v = m.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{label} {v:.3g}")
    return "  ".join(parts)


def _display():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from gymv.train import Reporter

    class Display(Reporter):
        """Rich progress on stderr: step m/n, reward, accuracy, step time; stdout stays clean for --json."""

        def __init__(self) -> None:
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                console=err_console)
            self.task = None
            self.warned = False

        def on_message(self, text: str) -> None:
            (self.bar.console if self.task is not None else err_console).print(f"[dim]{text}[/dim]")

        def on_start(self, info: dict) -> None:
            if info.get("resumed_from"):
                err_console.print(f"[dim]resuming from {info['resumed_from']}[/dim]")
            self.task = self.bar.add_task(info["algorithm"], total=info["max_steps"], completed=info["start_step"], info="")
            self.bar.start()

        def on_step(self, step: int, metrics: dict) -> None:
            if self.task is None:
                return
            text = _row_text(step, metrics)
            if "val/accuracy" in metrics:
                self.bar.console.print(f"step {step}: val accuracy {metrics['val/accuracy']:.3f}  "
                                       f"reward {metrics.get('val/reward_mean', float('nan')):.3f}")
            self.bar.update(self.task, completed=step, info=text)
            err = metrics.get("train/token_mult_prob_error")
            if "async/age_mean" in metrics and metrics["async/age_mean"] > 0:
                err = None  # async: the trainer is ahead of the weights that sampled, by design (docs/async.md)
            if isinstance(err, float) and err > 1.05 and not self.warned:
                self.warned = True
                self.bar.console.print(f"[yellow]step {step}: token_mult_prob_error {err:.3f} > 1.05: the generator's "
                                       "logprobs disagree with the trainer's (stale encoder cache? refit dtype?)[/yellow]")

        def on_checkpoint(self, step: int, path) -> None:
            self.bar.console.print(f"[dim]checkpoint {path}[/dim]")

        def stop(self) -> None:
            self.bar.stop()

    return Display()


def _summary_rows(summary: dict) -> list[tuple[str, str]]:
    rows = []
    for k, v in summary.items():
        if v is None:
            continue
        rows.append((k, f"{v:.4g}" if isinstance(v, float) else str(v)))
    return rows


def train(
    recipe: str = typer.Argument(None, help="Recipe YAML (optional with --resume: the run's own config.yaml)."),
    overrides: list[str] = typer.Argument(None, help="Overrides KEY=VALUE, +KEY=VALUE, ~KEY.", show_default=False),
    resume: Path = typer.Option(None, "--resume", help="Continue this run directory from its newest checkpoint."),
    ray_address: str = typer.Option(None, "--ray-address", help="Join this Ray cluster (HOST:PORT or auto) instead of starting one."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout instead of the table."),
    async_grpo: bool = typer.Option(False, "--async", help="GRPO with generation running ahead of training "
                                    "(grpo.async.enabled; needs grpo.importance_sampling)."),
) -> None:
    from gymv.train import train as run_training

    overrides = list(overrides or [])
    if recipe is not None and "=" in recipe and not Path(recipe).exists() and resume is not None:
        overrides.insert(0, recipe)  # `gymv train --resume DIR a.b=c`: no recipe, only overrides
        recipe = None
    display = _display()
    try:
        summary = run_training(recipe, overrides, resume_dir=str(resume) if resume else None,
                               ray_address=ray_address, reporter=display, async_grpo=async_grpo)
    finally:
        display.stop()
    if json_out:
        print_json(summary)
    else:
        console.print(table(f"gymv train: {summary['run_dir']}", ["", "value"], _summary_rows(summary),
                            justify_numbers=False))


train.__doc__ = _HELP
