"""Every bad input is one GymvError line naming the file and line, and saying how to fix it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gymv.config import load_recipe
from gymv.errors import GymvError


def write(root: Path, name: str, text: str) -> Path:
    p = root / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def error(path: Path, *overrides: str) -> GymvError:
    with pytest.raises(GymvError) as e:
        load_recipe(path, overrides)
    assert e.value.fix, "every error says how to fix it"
    assert "\n" not in str(e.value)
    return e.value


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    p = write(tmp_path, "bad.yaml", "algorithm: grpo\ngrpo:\n  max_steps: [1, 2\n")
    e = error(p)
    assert e.where.endswith("bad.yaml:4:1") and "YAML syntax error" in e.message


def test_missing_parent_names_the_declaring_file_and_line(tmp_path):
    p = write(tmp_path, "r.yaml", "# comment\ndefaults:\n  - nowhere.yaml\nalgorithm: grpo\n")
    e = error(p)
    assert e.where.endswith("r.yaml:3") and "'nowhere.yaml' not found" in e.message


def test_defaults_cycle_shows_the_whole_chain(tmp_path):
    write(tmp_path, "a.yaml", "defaults: b.yaml\n")
    write(tmp_path, "b.yaml", "defaults: c.yaml\n")
    write(tmp_path, "c.yaml", "defaults: a.yaml\n")
    e = error(tmp_path / "a.yaml")
    assert "a.yaml -> " in e.message and "b.yaml -> " in e.message and "c.yaml -> " in e.message
    assert e.message.rstrip().endswith("a.yaml") and e.where.endswith("c.yaml:1")


def test_a_file_naming_itself_as_default_is_a_cycle(tmp_path):
    p = write(tmp_path, "a.yaml", "defaults: a.yaml\n")
    assert "cycle" in error(p).message


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just text\n", "str"), ("", "empty")])
def test_a_root_that_is_not_a_mapping_is_an_error(tmp_path, text, kind):
    e = error(write(tmp_path, "r.yaml", text))
    assert kind in e.message and "mapping" in e.message and e.where.endswith("r.yaml:1")


def test_bad_indentation_names_the_line_and_column(tmp_path):
    e = error(write(tmp_path, "bad.yaml", "algorithm: grpo\ngrpo:\n  max_steps: 1\n bad: 2\n"))
    assert e.where.endswith("bad.yaml:4:2")


def test_a_duplicate_key_is_an_error_naming_both_lines(tmp_path):
    e = error(write(tmp_path, "r.yaml", "algorithm: grpo\nseed: 1\nseed: 2\n"))
    assert e.where.endswith("r.yaml:3") and "first written on line 2" in e.message


def test_defaults_of_the_wrong_type_is_an_error(tmp_path):
    e = error(write(tmp_path, "r.yaml", "defaults: {a: 1}\n"))
    assert "`defaults` must be a path or a list of paths" in e.message and e.where.endswith("r.yaml:1")


def test_wrong_type_names_the_dotted_key_and_the_line_that_wrote_it(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: grpo\n")
    p = write(tmp_path, "r.yaml", "defaults: base.yaml\ngrpo:\n  max_steps: many\n")
    e = error(p)
    assert e.where.endswith("r.yaml:3") and "`grpo.max_steps`" in e.message and "'many'" in e.message


def test_unknown_key_names_the_dotted_path_its_line_and_the_close_match(tmp_path):
    p = write(tmp_path, "r.yaml", "algorithm: grpo\ngrpo:\n  loss:\n    clip_lo: 0.1\n")
    e = error(p)
    assert e.where.endswith("r.yaml:4") and "unknown key `grpo.loss.clip_lo`" in e.message
    assert "did you mean `grpo.loss.clip_low`?" in e.fix


def test_unknown_key_is_located_in_the_parent_that_wrote_it(tmp_path):
    write(tmp_path, "base.yaml", "algorithm: grpo\nenv:\n  nmae: x\n")
    e = error(write(tmp_path, "r.yaml", "defaults: base.yaml\n"))
    assert e.where.endswith("base.yaml:3")


def test_bad_choice_suggests_the_closest_allowed_value(tmp_path):
    e = error(write(tmp_path, "r.yaml", "algorithm: grpo\ngeneration: {backend: vllim}\n"))
    assert "'vllim' is not one of 'hf', 'vllm'" in e.message and "did you mean 'vllm'?" in e.fix


def test_unknown_algorithm_suggests_the_closest(tmp_path):
    e = error(write(tmp_path, "r.yaml", "algorithm: gpro\n"))
    assert e.where.endswith("r.yaml:1") and "did you mean 'grpo'?" in e.fix


def test_missing_algorithm_is_an_error(tmp_path):
    assert "missing required key `algorithm`" in error(write(tmp_path, "r.yaml", "seed: 1\n")).message


def test_bad_interpolation_reference_names_the_file_and_line(tmp_path):
    e = error(write(tmp_path, "r.yaml", "algorithm: grpo\nname: run-${nope.key}\n"))
    assert e.where.endswith("r.yaml:2") and "${nope.key}" in e.message


def test_a_compatibility_error_points_at_the_offending_key(tmp_path):
    p = write(tmp_path, "r.yaml", "algorithm: grpo\ngrpo:\n  async: {enabled: true}\n")
    e = error(p)
    assert "importance_sampling.kind is 'none'" in e.message and e.where.endswith("r.yaml:2")


def test_steps_per_run_with_checkpoints_off_is_refused_naming_both_keys(tmp_path):
    p = write(tmp_path, "r.yaml", "algorithm: grpo\ncheckpoint:\n  enabled: false\n  steps_per_run: 2\n")
    e = error(p)
    assert "steps_per_run" in e.message and "enabled: true" in e.message


@pytest.mark.parametrize("entry", ["/etc/passwd", "../../../../../../../../etc/passwd"])
def test_a_default_outside_the_recipe_tree_is_refused_naming_the_allowed_roots(tmp_path, entry):
    p = write(tmp_path, "recipes/vlm/r.yaml", f"defaults: {entry}\n")
    e = error(p)
    assert e.where.endswith("r.yaml:1") and "outside the recipe tree" in e.message
    assert str((tmp_path / "recipes").resolve()) in e.message and "GYMV_RECIPE_ROOTS" in e.fix


@pytest.mark.parametrize("entry", ["gymv://../../../../../../etc/passwd", "gymv://../LICENSE"])
def test_a_packaged_default_is_confined_to_the_shipped_recipes(tmp_path, entry):
    e = error(write(tmp_path, "r.yaml", f"defaults: {entry}\n"))
    assert "leaves gymv's shipped recipes" in e.message


def test_an_absolute_packaged_default_is_looked_up_inside_the_shipped_recipes(tmp_path):
    e = error(write(tmp_path, "r.yaml", "defaults: gymv:///etc/passwd\n"))
    assert "not found" in e.message and "recipes/etc/passwd" in e.message


def test_a_default_in_the_recipe_tree_may_climb_within_it(tmp_path):
    write(tmp_path, "recipes/base.yaml", "algorithm: grpo\nseed: 3\n")
    p = write(tmp_path, "recipes/vlm/deep/r.yaml", "defaults: ../../base.yaml\n")
    assert load_recipe(p, validate=False).raw["seed"] == 3


def test_a_folder_the_user_allows_may_hold_defaults(tmp_path, monkeypatch):
    write(tmp_path, "shared/base.yaml", "algorithm: grpo\nseed: 4\n")
    p = write(tmp_path, "recipes/r.yaml", "defaults: ../shared/base.yaml\n")
    assert "outside the recipe tree" in error(p).message
    monkeypatch.setenv("GYMV_RECIPE_ROOTS", str(tmp_path / "shared"))
    assert load_recipe(p, validate=False).raw["seed"] == 4


def test_a_nul_byte_in_a_value_is_an_error_naming_the_key(tmp_path):
    p = write(tmp_path, "r.yaml", 'defaults: gymv://vlm/vlm_grpo-tinyllava-1n0g-torch.yaml\ndata:\n  train: "a\\0b.jsonl"\n')
    e = error(p)
    assert e.where.endswith("r.yaml:3") and "`data.train` holds a NUL byte" in e.message


def test_an_override_that_is_not_utf8_is_an_error_not_a_traceback(tmp_path):
    p = write(tmp_path, "r.yaml", "defaults: gymv://vlm/vlm_grpo-tinyllava-1n0g-torch.yaml\n")
    bad = b"data.train=\xff.jsonl".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    e = error(p, bad)
    assert "override is not UTF-8 text" in e.message and "LANG" in e.fix
