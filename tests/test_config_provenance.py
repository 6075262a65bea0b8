"""Provenance: every key of the merged config knows the file and line that last wrote it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from gymv.config import check_minimal, load_recipe


def write(root: Path, name: str, text: str) -> Path:
    p = root / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def test_origin_names_the_file_and_line_of_the_winning_value(tmp_path):
    write(tmp_path, "base.yaml", """
        algorithm: grpo
        grpo:
          max_steps: 10
          prompts_per_step: 4
    """)
    child = write(tmp_path, "child.yaml", """
        defaults: base.yaml
        grpo:
          prompts_per_step: 8
    """)
    loaded = load_recipe(child)
    file, line = loaded.origin("grpo.prompts_per_step")
    assert (Path(file).name, line) == ("child.yaml", 3)
    assert str(loaded.origin("grpo.max_steps")).endswith("base.yaml:3")


def test_a_replaced_section_forgets_the_parents_keys(tmp_path):
    write(tmp_path, "base.yaml", "env:\n  kwargs: {a: 1, b: 2}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\nenv:\n  kwargs:\n    _override_: true\n    c: 3\n")
    loaded = load_recipe(child, validate=False)
    assert loaded.origin("env.kwargs.a") is None
    assert str(loaded.origin("env.kwargs.c")).endswith("child.yaml:5")


def test_a_list_item_has_its_own_line(tmp_path):
    loaded = load_recipe(write(tmp_path, "r.yaml", "algorithm: grpo\nchecks:\n  - a\n  - b\n"))
    assert loaded.origin("checks.1").line == 4


def test_origin_of_a_dotted_key_inside_a_mapping_with_dotted_keys(tmp_path):
    loaded = load_recipe(write(tmp_path, "r.yaml", "algorithm: grpo\nsmoke:\n  grpo.max_steps: 2\n"))
    assert loaded.origin("smoke.grpo.max_steps").line == 3


def test_origin_of_an_unknown_key_is_none(tmp_path):
    assert load_recipe(write(tmp_path, "r.yaml", "algorithm: grpo\n")).origin("grpo.nope") is None


def test_own_holds_only_the_files_own_keys(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: grpo\nseed: 1\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\nseed: 2\n")
    assert load_recipe(child).own.data == {"seed": 2}


def test_a_leaf_equal_to_what_it_inherits_is_reported_with_both_locations(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: grpo\ngrpo: {max_steps: 10, prompts_per_step: 4}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\ngrpo:\n  max_steps: 10.0\n  prompts_per_step: 8\n")
    [f] = check_minimal(load_recipe(child))
    assert f.key == "grpo.max_steps" and f.where.endswith("child.yaml:3") and "base.yaml:2" in f.message


def test_a_true_that_repeats_a_one_is_not_redundant(tmp_path):
    write(tmp_path, "base.yaml", "a: 1\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\na: true\n")
    assert check_minimal(load_recipe(child, validate=False)) == []


def test_a_replaced_section_needs_its_leaves_unless_it_equals_the_parent(tmp_path):
    write(tmp_path, "base.yaml", "t:\n  a: {p: 1}\n  b: {p: 2}\n")
    keep = write(tmp_path, "keep.yaml", "defaults: base.yaml\nt:\n  _override_: true\n  a: {p: 1}\n")
    same = write(tmp_path, "same.yaml", "defaults: base.yaml\nt:\n  _override_: true\n  a: {p: 1}\n  b: {p: 2}\n")
    assert check_minimal(load_recipe(keep, validate=False)) == []
    assert [f.key for f in check_minimal(load_recipe(same, validate=False))] == ["t"]
