"""`gymv prepare ENV`: write a deterministic dataset of ENV's rows in NeMo Gym's format."""

from __future__ import annotations

from pathlib import Path

import typer

from gymv.errors import GymvError

_HELP = """Generate a dataset of ENV rows (NeMo Gym JSONL, images as PNG data URLs).

The same arguments always give a byte-identical file; train and eval rows come from disjoint seed ranges.
Knobs (KEY=VALUE after the options) override the preset; --list-knobs shows them.

Examples:

  gymv prepare circle-count --n 1000 --out data/train.jsonl

  gymv prepare circle-count --n 200 --split eval --out data/eval.jsonl --preview eval.png

  gymv prepare circle-count --preset tiny --n 5000 --out tiny.jsonl circles=1:5 colors=1:2

  gymv prepare mix circle-count:tiny:200 arithmetic:tiny:200 --out data/mixed-train.jsonl

ENV `mix` writes several environments' rows into one file: each part ENV:N or ENV:PRESET:N holds exactly the
rows `gymv prepare ENV --preset PRESET --n N` would (same --split and --seed), evenly interleaved.
"""


def prepare(
    env: str = typer.Argument(..., metavar="ENV", help="Environment to generate rows for, e.g. circle-count or circle-click."),
    knobs: list[str] = typer.Argument(None, help="Knob overrides KEY=VALUE, e.g. circles=1:3 radius=7.", show_default=False),
    n: int = typer.Option(None, "--n", help="Number of rows."),
    out: Path = typer.Option(None, "--out", help="Output JSONL file (written atomically)."),
    seed: int = typer.Option(0, "--seed", help="First row's seed within the split's own seed range."),
    split: str = typer.Option("train", "--split", help="train or eval (disjoint seed ranges)."),
    preset: str = typer.Option("default", "--preset", help="Knob preset: default (NeMo Gym's generator) or tiny."),
    workers: int = typer.Option(0, "--workers", help="Worker processes (0: all cores)."),
    preview: Path = typer.Option(None, "--preview", help="Also write a contact sheet PNG of sample rows."),
    preview_count: int = typer.Option(16, "--preview-count", help="Rows on the contact sheet."),
    list_knobs: bool = typer.Option(False, "--list-knobs", help="Show the knobs of ENV's preset and exit."),
    json_out: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
) -> None:
    from gymv.data.generate import write_dataset
    from gymv.envs import get_env
    from gymv.envs.knobs import describe_knobs, knobs_dict, resolve_knobs
    from gymv_cli.output import console, print_json, progress, table

    if env == "mix":
        _prepare_mix(knobs or [], out=out, seed=seed, split=split, preset=preset, workers=workers, preview=preview,
                     list_knobs=list_knobs, n=n, json_out=json_out)
        return
    environment = get_env(env)
    resolved = resolve_knobs(environment, preset, knobs or [])
    if list_knobs:
        if json_out:
            print_json({"env": environment.name, "preset": preset, "knobs": knobs_dict(resolved)})
        else:
            console.print(table(f"{environment.name} knobs (preset {preset})", ["knob", "value", "meaning"],
                                describe_knobs(resolved), justify_numbers=False))
        return
    if n is None or out is None:
        raise GymvError("--n and --out are required",
                        fix=f"e.g. gymv prepare {environment.name} --n 100 --out rows.jsonl")
    if preview_count < 1:
        raise GymvError("--preview-count must be at least 1", fix="pass --preview-count 1 or more")

    sample: list[str] = []
    bar = progress()
    task = bar.add_task(f"{environment.name} {split}", total=n)

    def on_row(line: str) -> None:
        if preview is not None and len(sample) < preview_count:
            sample.append(line)
        bar.advance(task)

    try:
        summary = write_dataset(out, environment, resolved, n=n, split=split, seed=seed, workers=workers or None,
                                on_row=on_row, on_start=bar.start)
    finally:
        bar.stop()

    if preview is not None:
        import json

        from gymv.envs.preview import contact_sheet

        contact_sheet(environment, [json.loads(s) for s in sample], preview)

    result = {
        "path": summary.path, "env": summary.env, "split": summary.split, "preset": preset, "rows": summary.rows,
        "seeds": [summary.first_seed, summary.last_seed], "bytes": summary.bytes,
        "seconds": round(summary.seconds, 3), "rows_per_second": round(summary.rows_per_second, 1),
        "preview": str(preview) if preview else None,
    }
    if json_out:
        print_json(result)
    else:
        console.print(
            f"wrote {summary.rows} {summary.env} rows ({summary.split}, seeds {summary.first_seed}..{summary.last_seed}) "
            f"to {summary.path}: {summary.bytes / 1e6:.1f} MB in {summary.seconds:.1f} s "
            f"({summary.rows_per_second:.0f} rows/s)" + (f"; preview {preview}" if preview else ""))


def _prepare_mix(spec: list[str], *, out, seed: int, split: str, preset: str, workers: int, preview, list_knobs: bool,
                 n, json_out: bool) -> None:
    from gymv.envs.mix import parse_mix_spec, write_mixed_dataset
    from gymv_cli.output import console, print_json, progress

    unsupported = [flag for flag, given in (("--preset", preset != "default"), ("--preview", preview is not None),
                                            ("--list-knobs", list_knobs), ("--n", n is not None)) if given]
    if unsupported:
        raise GymvError(f"gymv prepare mix does not take {', '.join(unsupported)}",
                        fix="give each part as ENV:PRESET:N, e.g. gymv prepare mix circle-count:tiny:200 arithmetic:tiny:200 --out mixed.jsonl")
    parts = parse_mix_spec(spec)
    if out is None:
        raise GymvError("--out is required",
                        fix="e.g. gymv prepare mix circle-count:tiny:200 arithmetic:tiny:200 --out mixed.jsonl")
    bar = progress()
    bar.live.auto_refresh = False  # no refresh thread: row workers are forked only from a single-threaded process
    task = bar.add_task(f"mix {split}", total=sum(p.n for p in parts))
    done = [0]

    def on_row() -> None:
        done[0] += 1
        bar.advance(task)
        if done[0] % 64 == 0:
            bar.refresh()

    bar.start()
    try:
        summary = write_mixed_dataset(out, parts, split=split, seed=seed, workers=workers or None, on_row=on_row)
        bar.refresh()
    finally:
        bar.stop()
    result = {"path": summary.path, "split": summary.split, "rows": summary.rows, "bytes": summary.bytes,
              "seconds": round(summary.seconds, 3),
              "parts": [{"env": e, "preset": p, "rows": k} for e, p, k in summary.parts]}
    if json_out:
        print_json(result)
    else:
        what = " + ".join(f"{k} {e} ({p})" for e, p, k in summary.parts)
        console.print(f"wrote {summary.rows} rows ({what}; {summary.split}, seed {seed}) to {summary.path}: "
                      f"{summary.bytes / 1e6:.1f} MB in {summary.seconds:.1f} s")


prepare.__doc__ = _HELP
