"""`gymv report RUN_DIR`: plots and an offline HTML rollout viewer for a finished or running run."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json, table


def report(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A run directory written by gymv train (runs/<name>)."),
    out: Path = typer.Option(None, "--out", file_okay=False, help="Folder to write the report to (default: RUN_DIR/report)."),
    serve: bool = typer.Option(False, "--serve", help="Serve the report on 127.0.0.1 until Ctrl-C; reloading the page picks up new steps."),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="Port for --serve (0: any free port)."),
    compare: list[Path] = typer.Option(None, "--compare", file_okay=False, help="Another run directory to draw in the same plots (dashed) and list beside this run's latest values; repeatable."),
    smoothing: float = typer.Option(0.6, "--smoothing", min=0.0, max=0.99, help="Weight of the moving average drawn over training curves (0: none; the raw curve stays, faint)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (files, counts, checks) instead of the table."),
) -> None:
    """Write PNG plots (reward, accuracy, loss, KL, entropy, token_mult_prob_error, gradient norm, response length, share of groups with equal rewards, learning rate, step-time split; training curves smoothed over the faint raw ones) and an HTML rollout viewer, newest step first: each GRPO group is one card with its prompt once and every sample's turns, images, tool calls and results, reward, advantage, and expected vs parsed answer; filters by reward and step.

    --compare OTHER_RUN draws another run's curves (dashed) into the same plots and its latest values beside this run's.

    The report folder is self-contained: open its index.html from disk, or copy it anywhere. A run still in progress is fine (a half-written last metrics line is skipped): run the command again, or use --serve and reload the page, to see new steps. The run's recipe checks are evaluated on the page. Filters are kept in the page address (#split=val&step=3&rmin=1), so a link shows the same rollouts.

    Example: gymv report runs/vlm_grpo-tinyllava-1n0g-torch --serve   (or: gymv report runs/a --compare runs/b)
    """
    from gymv.report import build_report, run_signature, serve_report

    signature = run_signature(run_dir)
    with err_console.status("building the report", spinner="dots"):
        result = build_report(run_dir, out, smoothing=smoothing, compare=compare or ())
    if json_out:
        print_json(result.to_dict())
    else:
        _render(result)
    if serve:
        server = serve_report(result.out_dir, run_dir, port=port, signature=signature,
                              build_options={"smoothing": smoothing, "compare": compare or ()})
        console.print(f"serving {result.out_dir} at [bold]{server.url}[/bold] (Ctrl-C stops)", highlight=False)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            err_console.print("stopped")
        finally:
            server.server_close()


def _render(result) -> None:
    rows = [("report", str(result.index)),
            ("plots", ", ".join(Path(p.file).stem for p in result.plots) or "none yet"),
            ("rollouts", f"{result.rollouts} ({result.images} distinct images)"),
            ("last step", "none yet" if result.last_step is None else f"{result.last_step}"
             + ("" if result.finished else " (in progress)"))]
    console.print(table("gymv report", ["", ""], rows, justify_numbers=False))
    if result.checks:
        console.print(table("Metric Checks", ["check", "result", "observed"],
                            [(c.text, c.status.upper(), c.error or c.observed_text()) for c in result.checks],
                            justify_numbers=False))
    for p in result.problems:
        err_console.print(f"warning: could not read {p}", markup=False, highlight=False)
