"""`gymv smoke RECIPE|SUITE`: run recipes for a few steps, each in its own process, and check their metrics."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json, table


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """Targets, then overrides (KEY=VALUE, +KEY=VALUE, ~KEY) in the order given."""
    targets, overrides = [], []
    for a in args:
        (overrides if "=" in a or a.startswith("~") else targets).append(a)
    return targets, overrides


def _minutes(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{int(s // 60)} min {int(s % 60)} s"


def _listener(quiet: bool):
    from gymv.smoke import SmokeListener

    class Status(SmokeListener):
        """One status line on stderr ("[2/5] name: training 12 s"); results go to stdout as they come."""

        def __init__(self) -> None:
            self.status = None
            self.prefix = ""

        def on_recipe_start(self, index, total, target) -> None:
            self.prefix = f"[{index + 1}/{total}] {target.shown}"
            self._show("preparing")

        def on_prepared(self, prepared) -> None:
            self._show(f"training {prepared.max_steps} step{'s' if prepared.max_steps != 1 else ''}")

        def on_tick(self, elapsed_s: float) -> None:
            if self.status is not None:
                self.status.update(f"{self.prefix}: training, {_minutes(elapsed_s)}")

        def on_result(self, result) -> None:
            self.stop()
            if not quiet:
                _render_result(result)

        def _show(self, text: str) -> None:
            if self.status is None:
                self.status = err_console.status("", spinner="dots")
                self.status.start()
            self.status.update(f"{self.prefix}: {text}")

        def stop(self) -> None:
            if self.status is not None:
                self.status.stop()
                self.status = None

    return Status()


_STYLE = {"PASS": "green", "FAIL": "red", "CRASH": "red", "TIMEOUT": "red", "CONFIG": "red"}


def _render_result(r) -> None:
    steps = "" if r.steps is None else f", step {r.steps} of {r.max_steps}"
    console.print(f"[bold]{r.recipe}[/bold]: [{_STYLE[r.status]}]{r.status}[/]{steps}, {_minutes(r.wall_s)}",
                  highlight=False)
    if r.reason and r.status != "FAIL":
        console.print(f"  reason: {r.reason}", markup=False, highlight=False)
        if r.log:
            console.print(f"  log: {r.log}", markup=False, highlight=False)
    if r.tiny_changes:
        console.print(f"  --tiny changed {len(r.tiny_changes)} settings (the run's recipe: "
                      f"{Path(r.run_dir).parent / (r.name + '.recipe.yaml')})", markup=False, highlight=False)
    for note in r.notes:
        console.print(f"  note: {note}", markup=False, highlight=False)
    rows = [(c.text, c.where or "", c.error if c.status in ("error", "skip") else c.observed_text(), c.status.upper())
            for c in (*r.checks, *r.driver_checks)]
    if rows:
        console.print(table(f"Metric Checks: {r.name}", ["check", "written at", "observed", "result"], rows,
                            justify_numbers=False))
    elif r.status not in ("CONFIG",):
        console.print("  no checks (add `checks:` to the recipe, e.g. median(train/token_mult_prob_error) < 1.1)",
                      markup=False, highlight=False)
    console.print()


def _short(text: str, n: int = 90) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _render_summary(report) -> None:
    rows = []
    for r in report.results:
        n = [c for c in (*r.checks, *r.driver_checks) if c.status != "skip"]
        ok = sum(c.status == "pass" for c in n)
        rows.append((r.recipe, r.status, "" if r.steps is None else str(r.steps),
                     f"{ok}/{len(n)}" if n else "-", _minutes(r.wall_s), _short(r.reason or "")))
    console.print(table(f"Smoke summary: {report.title}", ["recipe", "result", "steps", "checks", "time", "reason"], rows,
                        justify_numbers=False))
    counts = report.counts()
    parts = [f"{counts[k]} {k.lower()}" for k in ("PASS", "FAIL", "CRASH", "TIMEOUT", "CONFIG") if counts.get(k)]
    verdict = "[green]passed[/green]" if report.passed else "[red]failed[/red]"
    console.print(f"smoke {verdict}: {', '.join(parts) or 'nothing ran'} of {len(report.results)} recipe"
                  f"{'s' if len(report.results) != 1 else ''} in {_minutes(report.wall_s)}; runs in {report.out_dir}",
                  highlight=False)


def smoke(
    args: list[str] = typer.Argument(..., metavar="RECIPE|SUITE... [KEY=VALUE...]",
                                     help="Recipes (.yaml), suite names (nightly, release, ...) or suite .txt files; "
                                          "then overrides applied to every recipe."),
    steps: int = typer.Option(None, "--steps", min=1, help="Steps per recipe (default: its smoke: section, else 2)."),
    tiny: bool = typer.Option(False, "--tiny", help="Embedded tiny model on the CPU: validates a GPU recipe's plumbing on a laptop."),
    junit: Path = typer.Option(None, "--junit", dir_okay=False, help="Also write JUnit XML to FILE."),
    out: Path = typer.Option(None, "--out", file_okay=False, help="Folder for the runs (default: runs/smoke/<time>)."),
    timeout: float = typer.Option(1800.0, "--timeout", min=1, help="Seconds a recipe may run before it is stopped."),
    ray_address: str = typer.Option(None, "--ray-address", help="Run every recipe on this Ray cluster instead of a fresh local one each."),
    recipes_dir: Path = typer.Option(None, "--recipes-dir", file_okay=False, help="Where suite names are looked up. Default: the project's recipes/, found from any sub-folder, else the recipes gymv ships."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (every recipe, check and reason) instead of tables."),
) -> None:
    """Run each recipe for a few steps, then evaluate its metric checks; exit 1 if any recipe fails.

    Each recipe is loaded with its smoke: section and the overrides, trained by `gymv train` in its own process (a crash or a hang is reported with its reason, and the next recipe runs), then judged against its checks: a "Metric Checks" table per recipe and a summary at the end. Full-run checks in a driver's CHECKS block count only when the run reaches the driver's MAX_STEPS.

    --tiny swaps in the embedded tiny model, CPU placement and small sizes while keeping the algorithm, environment, turns, async and teachers, so the plumbing of a GPU recipe is tested on a laptop.

    Example: gymv smoke nightly --tiny --junit smoke.xml   (or: gymv smoke recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml --steps 3)
    """
    from gymv.errors import GymvError
    from gymv.config.exemplars import project_recipes_dir
    from gymv.smoke import run_smoke, write_junit

    recipes_dir = recipes_dir or project_recipes_dir()

    targets, overrides = _split(list(args))
    if not targets:
        raise GymvError("no recipe or suite given", fix="gymv smoke RECIPE|SUITE [KEY=VALUE ...]")
    listener = _listener(quiet=json_out)
    try:
        report = run_smoke(targets, overrides=overrides, steps=steps, tiny=tiny, out_dir=out, timeout_s=timeout,
                           ray_address=ray_address, recipes_dir=recipes_dir, listener=listener)
    finally:
        listener.stop()
    if junit is not None:
        write_junit(junit, report.results, report.title)
    if json_out:
        print_json(report.to_dict())
    else:
        _render_summary(report)
        if junit is not None:
            console.print(f"JUnit XML: {junit}", highlight=False)
    if not report.passed:
        raise typer.Exit(1)
