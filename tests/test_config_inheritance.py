"""`defaults:` inheritance: which file wins, how sections merge, and how `_override_` replaces."""

from __future__ import annotations

import textwrap
from pathlib import Path

from gymv.config import load_recipe


def write(root: Path, name: str, text: str) -> Path:
    p = root / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def raw(path: Path, **kw) -> dict:
    return load_recipe(path, validate=False, **kw).raw


def test_a_string_default_inherits_every_key_of_the_parent(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: grpo\nseed: 7\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\nname: x\n")
    assert raw(child) == {"algorithm": "grpo", "seed": 7, "name": "x"}


def test_a_list_of_defaults_applies_every_parent(tmp_path):
    write(tmp_path, "a.yaml", "algorithm: grpo\n")
    write(tmp_path, "b.yaml", "seed: 3\n")
    child = write(tmp_path, "child.yaml", "defaults: [a.yaml, b.yaml]\n")
    assert raw(child) == {"algorithm": "grpo", "seed": 3}


def test_default_paths_are_relative_to_the_declaring_file_not_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path, "recipes/exemplar.yaml", "algorithm: grpo\n")
    write(tmp_path, "recipes/vlm/mid.yaml", "defaults: ../exemplar.yaml\nseed: 1\n")
    child = write(tmp_path, "recipes/vlm/deep/child.yaml", "defaults: ../mid.yaml\n")
    monkeypatch.chdir(tmp_path / "recipes" / "vlm")
    assert raw(child) == {"algorithm": "grpo", "seed": 1}


def test_later_defaults_win_over_earlier_ones(tmp_path):
    write(tmp_path, "a.yaml", "seed: 1\n")
    write(tmp_path, "b.yaml", "seed: 2\n")
    child = write(tmp_path, "child.yaml", "defaults: [a.yaml, b.yaml]\n")
    assert raw(child)["seed"] == 2


def test_the_file_itself_wins_over_its_defaults(tmp_path):
    write(tmp_path, "a.yaml", "seed: 1\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\nseed: 9\n")
    assert raw(child)["seed"] == 9


def test_defaults_are_applied_depth_first_so_a_later_sibling_beats_an_earlier_grandparent(tmp_path):
    write(tmp_path, "grand.yaml", "seed: 1\nname: grand\n")
    write(tmp_path, "a.yaml", "defaults: grand.yaml\n")
    write(tmp_path, "b.yaml", "seed: 2\n")
    child = write(tmp_path, "child.yaml", "defaults: [a.yaml, b.yaml]\n")
    loaded = load_recipe(child, validate=False)
    assert loaded.raw == {"seed": 2, "name": "grand"}
    assert [p.name for p in loaded.chain] == ["grand.yaml", "a.yaml", "b.yaml", "child.yaml"]


def test_mappings_deep_merge(tmp_path):
    write(tmp_path, "a.yaml", "grpo:\n  loss: {clip_low: 0.1, clip_high: 0.2}\n  max_steps: 5\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\ngrpo:\n  loss: {clip_high: 0.3}\n")
    assert raw(child) == {"grpo": {"loss": {"clip_low": 0.1, "clip_high": 0.3}, "max_steps": 5}}


def test_lists_replace_instead_of_appending(tmp_path):
    write(tmp_path, "a.yaml", "checks: [one, two]\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\nchecks: [three]\n")
    assert raw(child)["checks"] == ["three"]


def test_a_scalar_replaces_an_inherited_mapping(tmp_path):
    write(tmp_path, "a.yaml", "data:\n  prepare: {n_train: 3}\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\ndata:\n  prepare: null\n")
    assert raw(child) == {"data": {"prepare": None}}


def test_override_marker_replaces_the_inherited_section_instead_of_merging(tmp_path):
    write(tmp_path, "a.yaml", "mopd:\n  teachers:\n    old: {path: a}\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\nmopd:\n  teachers:\n    _override_: true\n    new: {path: b}\n")
    assert raw(child) == {"mopd": {"teachers": {"new": {"path": "b"}}}}


def test_override_marker_false_merges_and_the_marker_never_reaches_the_result(tmp_path):
    write(tmp_path, "a.yaml", "env: {name: a, retries: 1}\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\nenv: {_override_: false, name: b}\n")
    assert raw(child) == {"env": {"name": "b", "retries": 1}}


def test_a_diamond_of_defaults_is_not_a_cycle(tmp_path):
    write(tmp_path, "root.yaml", "seed: 1\n")
    write(tmp_path, "a.yaml", "defaults: root.yaml\n")
    write(tmp_path, "b.yaml", "defaults: root.yaml\n")
    child = write(tmp_path, "child.yaml", "defaults: [a.yaml, b.yaml]\n")
    assert raw(child) == {"seed": 1}


def test_parent_view_is_the_recipe_without_its_own_keys(tmp_path):
    write(tmp_path, "a.yaml", "seed: 1\nname: a\n")
    child = write(tmp_path, "child.yaml", "defaults: a.yaml\nseed: 2\n")
    view = load_recipe(child, validate=False).parent_view()
    assert view.data == {"seed": 1, "name": "a"}
    assert view.origin("seed").file.endswith("a.yaml")
