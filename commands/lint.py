"""`gymv lint [PATHS]`: check recipes, drivers and suites against the conventions, with stable rule IDs."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from gymv_cli.output import console, err_console, print_json


class Format(str, Enum):
    auto = "auto"
    table = "table"
    text = "text"
    json = "json"
    github = "github"


def lint(
    paths: list[Path] = typer.Argument(
        None, metavar="[PATHS]...",
        help="Recipes (.yaml), drivers (.sh), suite lists (.txt) or directories, searched recursively. Default: the project's recipes/ (found from any sub-folder).",
    ),
    fmt: Format = typer.Option(Format.auto, "--format", "-f", case_sensitive=False,
                               help="table, text (one `path:line: ID message (fix: ...)` per line), json, or github "
                                    "(workflow annotations). auto: table on a terminal, text when piped."),
    json_out: bool = typer.Option(False, "--json", help="Same as --format json."),
    fix: bool = typer.Option(False, "--fix", help="Delete redundant leaves (GV003) in place, keeping comments and layout; "
                                                "then report what is left."),
    list_rules: bool = typer.Option(False, "--list-rules", help="Print the rule table and exit."),
) -> None:
    """Check recipes, their drivers and the suite lists; exit 0 when clean, 1 on findings, 2 on a usage or I/O error.

    Rules (stable IDs GV001...; --list-rules shows them): the recipe loads, inherits its exemplar, is minimal, is named
    for what it runs; the 1:1:1 rule (one driver, exactly one suite); disabled entries say why; driver CONFIG blocks
    parse and agree with the recipe and the suite's nodes; the config passes the schema and the compatibility rules;
    suites stay within their GPU-hour budgets.

    Example: gymv lint   (or: gymv lint recipes/vlm --format github, gymv lint --fix recipes/llm/x.yaml)
    """
    from gymv.config.lint import RULES, fix_minimality, fixable_files, lint_paths
    from gymv.errors import GymvError

    if list_rules:
        from gymv_cli.output import table

        console.print(table("gymv lint rules", ["ID", "rule", "what", "fix"], [(r.id, r.name, r.what, r.fix) for r in RULES]))
        return
    if json_out:
        fmt = Format.json
    if fmt is Format.auto:
        fmt = Format.table if console.is_terminal else Format.text
    from gymv.config.exemplars import project_recipes_dir

    targets = paths or [project_recipes_dir()]
    report = lint_paths(targets)
    if fix:
        fixed = 0
        for path in fixable_files(report):
            try:
                result = fix_minimality(path)
            except GymvError as e:
                err_console.print(f"not fixed: {e.one_line()}", markup=False, highlight=False, soft_wrap=True)
                continue
            if result.changed:
                fixed += 1
                err_console.print(f"fixed {path}: removed {', '.join(result.removed)} ({result.lines_removed} lines)",
                                  markup=False, highlight=False, soft_wrap=True)
            for key in result.left:
                err_console.print(f"not fixed: {path}: `{key}` sits inside a flow mapping {{...}}; delete it by hand",
                                  markup=False, highlight=False, soft_wrap=True)
        if fixed:
            report = lint_paths(targets)
    _render(report, fmt)
    if report.findings:
        raise typer.Exit(1)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _summary(report) -> str:
    files = _count(report.files, "file")
    if not report.findings:
        return f"no findings in {files}"
    return f"{_count(report.errors, 'error')}, {_count(report.warnings, 'warning')} in {files}"


def _escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def _render(report, fmt: Format) -> None:
    if fmt is Format.json:
        print_json(report.to_dict())
        return
    if fmt is Format.github:
        for f in report.findings:
            level = "warning" if f.severity == "warning" else "error"
            msg = f"{f.rule} {f.message}" + (f" (fix: {f.fix})" if f.fix else "")
            print(f"::{level} file={_escape(f.path, True)},line={f.line},title={f.rule}::{_escape(msg)}")
        err_console.print(_summary(report), markup=False, highlight=False)
        return
    if fmt is Format.text:
        for f in report.findings:
            print(f.one_line())
        err_console.print(_summary(report), markup=False, highlight=False)
        return
    from rich.table import Table
    from rich.text import Text

    if report.findings:
        t = Table(title="gymv lint", title_justify="left")
        t.add_column("location", overflow="fold")
        t.add_column("rule")
        t.add_column("finding", overflow="fold")
        for f in report.findings:
            rule = Text(f.rule, style="yellow" if f.severity == "warning" else "red")
            text = Text(f.message)
            if f.fix:
                text.append(f"\nfix: {f.fix}", style="dim")
            t.add_row(f"{f.path}:{f.line}", rule, text)
        console.print(t)
    console.print(_summary(report), markup=False, highlight=False)
