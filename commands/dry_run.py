"""`gymv dry-run`: GPU-hours of test-suite drivers, read from their CONFIG blocks without running them."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json


def dry_run(
    targets: list[str] = typer.Argument(
        None, metavar="SUITE|PATH",
        help="Suite names (nightly, release, ...), suite .txt files (gymv's recipe lists, or NeMo RL's lists of driver "
             ".sh paths), drivers (.sh), recipes (.yaml) or directories (searched recursively). Default: every suite "
             "except disabled.",
    ),
    recipes_dir: Path = typer.Option(None, "--recipes-dir", file_okay=False, help="The recipes directory (holds suites/ and drivers/). Default: the project's recipes/, found from any sub-folder, else the recipes gymv ships."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (drivers, per-suite subtotals and budgets, total) instead of tables."),
    fail_over_budget: bool = typer.Option(False, "--fail-over-budget", help="Exit 1 when a suite's GPU-hours exceed its budget."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Cost every driver that can be costed, name those that cannot, print the total of the rest (exit 1 if any was left out)."),
) -> None:
    """Count the GPU-hours of test-suite drivers without running them.

    Each driver's CONFIG block is parsed on its own, never executed; a wrapper that execs another driver counts once, with its values. GPU-hours = NUM_RUNS x NUM_NODES x GPUS_PER_NODE x NUM_MINUTES / 60.

    Rounding: each driver's GPU-hours are kept exact (as whole GPU-minutes) and summed exactly; only printed figures are rounded, half up, to 2 decimals. The last line printed is always 'Total GPU hours: N'.

    The first line says which recipes directory was read: the project's (found from the working directory),
    the one given with --recipes-dir, or the one gymv ships.

    Example: gymv dry-run nightly   (or: gymv dry-run recipes/drivers/vlm --json;
             gymv dry-run tests/test_suites/nightly.txt --keep-going   for a tree with broken drivers)
    """
    from gymv.config.exemplars import default_recipes_root, project_recipes_dir
    from gymv.recipes.gpu_hours import plan

    source = "given with --recipes-dir" if recipes_dir else None
    recipes_dir = recipes_dir or project_recipes_dir()
    if source is None:
        shipped = recipes_dir.resolve() == default_recipes_root().resolve()
        source = "the recipes shipped with gymv: no project recipes/ here" if shipped else "this project's"
    result = plan(targets or (), recipes_dir, keep_going=keep_going)
    if not json_out:
        print(f"recipes: {recipes_dir} ({source})", flush=True)
    for w in result.warnings():
        err_console.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)
    if json_out:
        print_json({"recipes_dir": str(recipes_dir), "recipes_source": source, **result.to_dict()})
    else:
        _render(result, recipes_dir)
    if result.skipped or (fail_over_budget and any(g.over_budget for g in result.groups)):
        raise typer.Exit(1)


def _shown(path: Path, drivers_dir: Path) -> str:
    """A driver's path relative to the drivers directory (the table title already says which suite)."""
    for base in (drivers_dir, Path.cwd()):
        try:
            return Path(path).relative_to(base.resolve() if base.is_absolute() else base).as_posix()
        except ValueError:
            continue
    return str(path)


def _under(path: Path, folder: Path) -> bool:
    try:
        Path(path).relative_to(folder)
        return True
    except ValueError:
        return False


def _render(result, recipes_dir: Path) -> None:
    from rich.table import Table

    from gymv.recipes.gpu_hours import format_gpu_hours, format_hours

    drivers_dir = recipes_dir / "drivers"
    for g in result.groups:
        listed = g.suite and not all(_under(d.config.path, drivers_dir) for d in g.drivers)
        title = (f"suite {g.suite} ({g.file})" + ("" if listed else f", drivers under {drivers_dir}")) if g.suite else "drivers"
        t = Table(title=title, title_justify="left")
        t.add_column("driver", overflow="fold")
        for col in ("nodes", "GPUs/node", "runs", "minutes", "GPU-hours"):
            t.add_column(col, justify="right")
        for d in g.drivers:
            c = d.config
            name = _shown(c.path, drivers_dir) + "".join(f"\n  exec {p.name}" for p in c.chain[1:])
            t.add_row(name, str(c.allocation("NUM_NODES")), str(c.allocation("GPUS_PER_NODE")), str(c.allocation("NUM_RUNS")),
                      str(c.allocation("NUM_MINUTES")),
                      format_gpu_hours(c.gpu_minutes))
        t.add_section()
        t.add_row("subtotal", "", "", "", "", format_gpu_hours(g.gpu_minutes), style="bold")
        if g.budget is not None:
            label, style = ("OVER BUDGET", "bold red") if g.over_budget else ("within budget", "green")
            t.add_row(label, "", "", "", "", format_hours(g.budget), style=style)
        console.print(t)
    console.file.flush()
    if result.skipped:
        print(f"Not costed ({len(result.skipped)}; the total leaves them out):")
        for k in result.skipped:
            print(f"  {k.error}")
    print(f"Total GPU hours: {format_gpu_hours(result.total_gpu_minutes)}", flush=True)
