"""Command-line overrides: set, add, upsert, delete, YAML-typed values, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymv.config import load_recipe, parse_override
from gymv.errors import GymvError


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text("algorithm: grpo\ngrpo:\n  prompts_per_step: 8\n  loss: {clip_low: 0.2}\nchecks: [a]\n")
    return p


def raw(path: Path, *overrides: str) -> dict:
    return load_recipe(path, overrides, validate=False).raw


def test_set_changes_an_existing_key(recipe):
    assert raw(recipe, "grpo.prompts_per_step=16")["grpo"]["prompts_per_step"] == 16


@pytest.mark.parametrize("text, value", [
    ("checks=[1,2]", [1, 2]), ("checks=null", None), ("checks=true", True), ("checks=1e-5", 1e-5),
    ("checks={a: 1}", {"a": 1}), ("checks=hello world", "hello world"), ("checks=", ""), ("checks='8'", "8"),
])
def test_values_are_read_as_yaml(recipe, text, value):
    assert raw(recipe, text)["checks"] == value


def test_set_of_an_unknown_key_names_it_and_suggests_the_close_match(recipe):
    with pytest.raises(GymvError) as e:
        raw(recipe, "grpo.prompt_per_step=4")
    msg = str(e.value)
    assert "unknown key 'grpo.prompt_per_step'" in msg and "did you mean grpo.prompts_per_step?" in msg
    assert "+grpo.prompt_per_step=4" in msg


def test_set_of_a_schema_key_the_recipe_leaves_at_its_default_is_allowed(recipe):
    assert raw(recipe, "grpo.max_steps=3")["grpo"]["max_steps"] == 3


def test_plus_adds_a_new_key_creating_sections(recipe):
    assert raw(recipe, "+env.kwargs.size=3")["env"] == {"kwargs": {"size": 3}}


def test_plus_on_an_existing_key_is_an_error(recipe):
    with pytest.raises(GymvError, match="already exists.*drop the '\\+'"):
        raw(recipe, "+grpo.prompts_per_step=1")


def test_double_plus_sets_whether_or_not_the_key_exists(recipe):
    r = raw(recipe, "++grpo.prompts_per_step=1", "++seed=5")
    assert (r["grpo"]["prompts_per_step"], r["seed"]) == (1, 5)


def test_tilde_deletes_a_key(recipe):
    assert "loss" not in raw(recipe, "~grpo.loss")["grpo"]


def test_tilde_on_a_missing_key_is_an_error(recipe):
    with pytest.raises(GymvError, match="unknown key 'grpo.nope'"):
        raw(recipe, "~grpo.nope")


def test_overrides_apply_in_order(recipe):
    assert raw(recipe, "grpo.prompts_per_step=1", "grpo.prompts_per_step=2")["grpo"]["prompts_per_step"] == 2


def test_an_override_without_equals_is_an_error():
    with pytest.raises(GymvError, match="override 'grpo.max_steps'.*no '='"):
        parse_override("grpo.max_steps")


def test_an_override_origin_is_the_command_line_argument(recipe):
    origin = load_recipe(recipe, ["grpo.prompts_per_step=3"], validate=False).origin("grpo.prompts_per_step")
    assert str(origin) == "<command line: grpo.prompts_per_step=3>"


def test_smoke_section_is_applied_as_overrides_when_asked(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("algorithm: grpo\ngrpo: {max_steps: 100}\nsmoke:\n  grpo.max_steps: 2\n")
    assert load_recipe(p, smoke=True).validated.grpo.max_steps == 2
    assert load_recipe(p).validated.grpo.max_steps == 100


def test_command_line_overrides_win_over_smoke(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("algorithm: grpo\nsmoke:\n  grpo.max_steps: 2\n")
    assert load_recipe(p, ["grpo.max_steps=7"], smoke=True).validated.grpo.max_steps == 7


def test_a_bad_smoke_key_is_reported_at_its_line_in_the_recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("algorithm: grpo\nsmoke:\n  grpo.max_step: 2\n")
    with pytest.raises(GymvError, match=r"r\.yaml:3: unknown key 'grpo.max_step'"):
        load_recipe(p, smoke=True)
