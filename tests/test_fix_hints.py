"""Every error's `fix=` that names a CLI option or a recipe key names one that exists.

The fixes are read from the source (every `fix=` keyword and every `Finding(...)`'s fix argument in gymv/,
commands/ and gymv_cli/), so an error added later is checked too. Options: `gymv CMD ... --opt` must be an
option of CMD; a bare `--opt` must be an option of some command. Recipe keys: a dotted name that starts with
a recipe section (`vision.max_image_pixels`, `grpo.max_steps=3`) must be a key of some algorithm's schema.
Text in `{...}` (an f-string's value) is skipped.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer

from gymv.config.validate import schema_has_key
from gymv_cli.completions import command_tree
from gymv_cli.main import build_app
from conftest import REPO

SOURCES = [*sorted((REPO / "gymv").rglob("*.py")), *sorted((REPO / "commands").glob("*.py")),
           *sorted((REPO / "gymv_cli").glob("*.py"))]
SECTIONS = ("model", "data", "env", "rollout", "generation", "training", "refit", "cluster", "checkpoint", "logger",
            "grpo", "sft", "mopd", "vision", "smoke")
ALGORITHMS = ("sft", "grpo", "mopd", "vlm_sft", "vlm_grpo", "vlm_mopd")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"\bgymv ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")
KEY = re.compile(r"(?<![\w./{$-])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-]|\.[a-z])")


def _texts(node: ast.expr) -> list[str]:
    """The literal text of a fix expression; f-string values become `{}`; both branches of an `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, ast.IfExp):
        return _texts(node.body) + _texts(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [a + b for a in _texts(node.left) or ["{}"] for b in _texts(node.right) or ["{}"]]
    return []


def fix_strings() -> list[tuple[str, str]]:
    """(file:line, text) of every fix written in the source."""
    out = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            exprs = []
            if isinstance(node, ast.keyword) and node.arg == "fix":
                exprs.append(node.value)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding" and len(node.args) >= 5:
                exprs.append(node.args[4])
            for e in exprs:
                where = f"{path.relative_to(REPO)}:{e.lineno}"
                out.extend((where, t) for t in _texts(e))
    return out


def _command_options() -> dict[tuple[str, ...], set[str]]:
    tree = command_tree(typer.main.get_command(build_app()))
    found: dict[tuple[str, ...], set[str]] = {}

    def visit(node) -> None:
        found[node.path] = {n for o in node.options for n in o.names}
        for sub in node.subcommands:
            visit(sub)

    visit(tree)
    return found


def _without_values(text: str) -> str:
    """The text without f-string values and without commands of other programs in backticks (`ray start --head`)."""
    text = re.sub(r"\{[^{}]*\}", " ", text)
    return re.sub(r"`(?!gymv )[a-z][\w.-]* [^`]*`", " ", text)


ERRORS = ("GymvError", "RowError", "ImageError", "WriteError")


def test_every_error_raised_says_how_to_fix_it():
    """A one-line error without a fix leaves the user guessing; a fix that is only an f-string's value
    (`fix=e.fix`, passed on) counts."""
    bare = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ERRORS and \
                    not any(k.arg in ("fix", None) for k in node.keywords):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bare, "errors without fix=: " + ", ".join(bare)


def test_the_source_has_fix_strings_to_check():
    assert len(fix_strings()) > 300


def test_every_cli_option_a_fix_names_exists():
    options = _command_options()
    every = set().union(*options.values())
    wrong = []
    for where, text in fix_strings():
        text = _without_values(text)
        for sentence in re.split(r"[;,(]|\bor\b", text):
            cmd = COMMAND.search(sentence)
            path = ()
            if cmd:
                path = (cmd.group(1),) + ((cmd.group(2),) if (cmd.group(1), cmd.group(2)) in options else ())
            for opt in OPTION.findall(sentence):
                allowed = options.get(path, every) if path else every
                if opt not in allowed:
                    wrong.append(f"{where}: {opt!r} ({'gymv ' + ' '.join(path) if path else 'no command'}) in {text!r}")
    assert not wrong, "\n".join(wrong)


def test_every_recipe_key_a_fix_names_exists():
    wrong = []
    for where, text in fix_strings():
        for m in KEY.finditer(_without_values(text)):
            key = m.group(1) + m.group(2)
            if not any(schema_has_key({"algorithm": a}, key) for a in ALGORITHMS):
                wrong.append(f"{where}: {key!r} in {text!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, option", [("pass --on-error skip", "--on-error"), ("gymv train --resume DIR", "--resume")])
def test_the_option_pattern_finds_options(text, option):
    assert OPTION.findall(text) == [option]


@pytest.mark.parametrize("text, key", [("raise vision.max_image_pixels", "vision.max_image_pixels"),
                                       ("set grpo.max_steps=3", "grpo.max_steps"),
                                       ("`training.lr`", "training.lr")])
def test_the_key_pattern_finds_keys(text, key):
    assert [m.group(1) + m.group(2) for m in KEY.finditer(text)] == [key]
