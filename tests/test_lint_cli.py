"""The `gymv lint` command: output formats, exit codes, --fix, and bad input as findings (never a traceback)."""

from __future__ import annotations

import json

import pytest

from gymv.config.lint import RULES
from lint_tree import Tree, block

GRPO = "recipes/llm/grpo-tiny-1n0g-torch.yaml"


@pytest.fixture
def tree(tmp_path) -> Tree:
    return Tree(tmp_path)


@pytest.fixture
def redundant(tree) -> Tree:
    """One GV003 finding: line 5 of the text recipe repeats the exemplar's seed."""
    tree.write("llm/grpo-tiny-1n0g-torch.yaml", "# tiny\ndefaults: ../grpo.yaml\n\nmodel:\n  dtype: auto   # same\n")
    return tree


def own_stderr(r) -> str:
    return "\n".join(line for line in r.stderr.splitlines() if not line.startswith("warning: command plugin"))


def test_clean_tree_exits_0(gymv, tree):
    r = gymv("lint", cwd=tree.base)
    assert r.code == 0, r.stdout + r.stderr
    assert r.stdout == "" and "no findings in 13 files" in r.stderr


def test_findings_exit_1_one_line_each_when_piped(gymv, redundant):
    r = gymv("lint", cwd=redundant.base)
    assert r.code == 1
    assert r.stdout.splitlines() == [
        f"{GRPO}:5: GV003 `model.dtype` repeats the inherited value 'auto' (from recipes/grpo.yaml:11) (fix: delete it)"]
    assert "1 error, 0 warnings in 13 files" in r.stderr


def test_format_table_shows_location_rule_message_and_fix(gymv, redundant):
    r = gymv("lint", "--format", "table", cwd=redundant.base)
    assert r.code == 1
    row = next(line for line in r.stdout.splitlines() if f"{GRPO}:5" in line)
    assert "GV003" in row and "`model.dtype` repeats" in row
    assert "fix: delete it" in r.stdout and "1 error, 0 warnings in 13 files" in r.stdout


def test_format_json_is_one_object_with_every_finding(gymv, redundant):
    r = gymv("lint", "--format", "json", cwd=redundant.base)
    assert r.code == 1
    out = json.loads(r.stdout)
    assert (out["files"], out["errors"], out["warnings"]) == (13, 1, 0)
    assert out["findings"] == [{"path": GRPO, "line": 5, "rule": "GV003", "severity": "error",
                                "message": "`model.dtype` repeats the inherited value 'auto' (from recipes/grpo.yaml:11)",
                                "fix": "delete it", "check": "recipe.minimal"}]


def test_json_flag_is_format_json(gymv, redundant):
    assert json.loads(gymv("lint", "--json", cwd=redundant.base).stdout)["errors"] == 1


def test_format_github_writes_workflow_annotations(gymv, redundant):
    redundant.add("llm/grpo-tiny-1n0g-torch-v2.yaml", "defaults: grpo-tiny-1n0g-torch.yaml\nseed: 3\n")
    redundant.driver("llm/grpo-tiny-1n0g-torch-v2.yaml", block().replace("NUM_MINUTES=30", "NUM_MINUTES=90"),
                     after='exec "$(dirname "$0")/grpo-tiny-1n0g-torch.sh" "$@"\n')
    r = gymv("lint", "--format", "github", cwd=redundant.base)
    lines = r.stdout.splitlines()
    assert lines[0] == (f"::warning file=recipes/drivers/llm/grpo-tiny-1n0g-torch-v2.sh,line=9,title=GV019::GV019 "
                        "NUM_MINUTES='90' does not reach the driver it execs (not exported); it runs with "
                        "'30' (fix: export NUM_MINUTES in "
                        "the wrapper, or have the driver default it: NUM_MINUTES=\"${NUM_MINUTES:-...}\")")
    assert lines[1].startswith(f"::error file={GRPO},line=5,title=GV003::GV003 `model.dtype` repeats")
    assert len(lines) == 2


def test_a_path_that_does_not_exist_exits_2(gymv, tree):
    r = gymv("lint", "recipes/nowhere", cwd=tree.base)
    assert r.code == 2 and own_stderr(r) == "error: recipes/nowhere: no such file or directory (fix: pass existing paths (default: recipes/))"


def test_a_file_that_is_no_recipe_driver_or_suite_exits_2(gymv, tree):
    (tree.base / "notes.md").write_text("hi\n")
    r = gymv("lint", "notes.md", cwd=tree.base)
    assert r.code == 2 and "notes.md: not a recipe (.yaml)" in r.stderr


def test_an_unknown_format_is_a_usage_error(gymv, tree):
    assert gymv("lint", "--format", "xml", cwd=tree.base).code == 2


def test_every_bad_input_is_a_finding_with_file_and_line_never_a_traceback(gymv, tree):
    bad = {
        "llm/grpo-syntax-1n0g-torch.yaml": ("defaults: ../grpo.yaml\ngrpo:\n  max_steps: [1, 2\n", "GV001", 4),
        "llm/grpo-parent-1n0g-torch.yaml": ("defaults:\n  - ../nowhere.yaml\n", "GV001", 2),
        "llm/grpo-cycle-1n0g-torch.yaml": ("defaults: grpo-cycle-1n0g-torch.yaml\n", "GV001", 1),
        "llm/grpo-list-1n0g-torch.yaml": ("- not\n- a mapping\n", "GV001", 1),
        "llm/grpo-type-1n0g-torch.yaml": ("defaults: ../grpo.yaml\ngrpo:\n  max_steps: many\n", "GV006", 3),
        "llm/grpo-key-1n0g-torch.yaml": ("defaults: ../grpo.yaml\nmodle:\n  path: x\n", "GV006", 2),
    }
    for rel, (text, _, _) in bad.items():
        tree.add(rel, text)
    drivers = {
        "llm/grpo-noend-1n0g-torch.yaml": ("# ===== BEGIN CONFIG =====\n" + block(), 4),
        "llm/grpo-subst-1n0g-torch.yaml": ("# ===== BEGIN CONFIG =====\nNUM_NODES=$(nproc)\n# ===== END CONFIG =====\n", 5),
        "llm/grpo-unknown-1n0g-torch.yaml": ("# ===== BEGIN CONFIG =====\nNUM_NODES=$NODES\n# ===== END CONFIG =====\n", 5),
    }
    for rel, (body, _) in drivers.items():
        tree.add(rel, "defaults: ../grpo.yaml\nseed: 1\n")
        tree.write("drivers/" + rel.replace(".yaml", ".sh"), f"#!/usr/bin/env bash\nset -eu\n\n{body}echo run\n")
    tree.write("suites/budgets.yaml", "nightly: 1000\nrelease: 1000\n")
    r = gymv("lint", "--format", "text", cwd=tree.base)
    assert r.code == 1 and "Traceback" not in r.stderr
    lines = r.stdout.splitlines()
    for rel, (_, rule, line) in bad.items():
        assert any(x.startswith(f"recipes/{rel}:{line}: {rule} ") for x in lines), (rel, lines)
    for rel, (_, line) in drivers.items():
        drv = "recipes/drivers/" + rel.replace(".yaml", ".sh")
        assert any(x.startswith(f"{drv}:{line}: GV014 ") for x in lines), (rel, lines)


def test_fix_rewrites_the_recipe_and_then_reports_it_clean(gymv, redundant):
    r = gymv("lint", "--fix", cwd=redundant.base)
    assert r.code == 0, r.stdout + r.stderr
    assert f"fixed {GRPO}: removed model (2 lines)" in r.stderr
    assert (redundant.base / GRPO).read_text() == "# tiny\ndefaults: ../grpo.yaml\n\n"


def test_list_rules_prints_every_rule(gymv, tree):
    r = gymv("lint", "--list-rules", cwd=tree.base)
    assert r.code == 0 and all(rule.id in r.stdout for rule in RULES)
