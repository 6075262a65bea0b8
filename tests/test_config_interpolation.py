"""`${...}` interpolation: resolved last, typed when whole, text when embedded, and the resolvers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gymv.config import load_recipe
from gymv.errors import GymvError


def write(root: Path, name: str, text: str) -> Path:
    p = root / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def resolved(tmp_path: Path, text: str, **kw) -> dict:
    return load_recipe(write(tmp_path, "r.yaml", text), validate=False, **kw).resolved


def test_a_whole_value_reference_keeps_the_referenced_type(tmp_path):
    r = resolved(tmp_path, "a: {n: 8, flag: true, xs: [1, 2]}\nb: ${a.n}\nc: ${a.flag}\nd: ${a.xs}\n")
    assert (r["b"], r["c"], r["d"]) == (8, True, [1, 2])


def test_a_reference_inside_a_string_is_substituted_as_text(tmp_path):
    r = resolved(tmp_path, "a: 8\nflag: false\nname: run-${a}-${flag}\n")
    assert r["name"] == "run-8-false"


def test_interpolation_is_resolved_after_merging_so_a_child_value_feeds_a_parent_reference(tmp_path):
    write(tmp_path, "base.yaml", "grpo: {prompts_per_step: 4}\ntotal: ${grpo.prompts_per_step}\n")
    child = write(tmp_path, "child.yaml", "defaults: base.yaml\ngrpo: {prompts_per_step: 16}\n")
    assert load_recipe(child, validate=False).resolved["total"] == 16


def test_overrides_feed_interpolation(tmp_path):
    r = resolved(tmp_path, "a: 1\nb: ${a}\n", overrides=["a=5"])
    assert r["b"] == 5


def test_raw_keeps_the_expression(tmp_path):
    loaded = load_recipe(write(tmp_path, "r.yaml", "a: 1\nb: ${a}\n"), validate=False)
    assert loaded.raw["b"] == "${a}"


def test_add_sums_numbers(tmp_path):
    assert resolved(tmp_path, "a: 2\nb: ${add:${a},3,0.5}\n")["b"] == 5.5


def test_mul_multiplies_nested_references(tmp_path):
    r = resolved(tmp_path, "grpo: {prompts_per_step: 8, generations_per_prompt: 4}\n"
                           "n: ${mul:${grpo.prompts_per_step},${grpo.generations_per_prompt}}\n")
    assert r["n"] == 32 and isinstance(r["n"], int)


def test_div_gives_an_int_when_it_divides_exactly_and_a_float_otherwise(tmp_path):
    r = resolved(tmp_path, "a: ${div:12,4}\nb: ${div:3,2}\n")
    assert (r["a"], type(r["a"]), r["b"]) == (3, int, 1.5)


def test_max_picks_the_largest(tmp_path):
    assert resolved(tmp_path, "a: 3\nb: ${max:1,${a},2}\n")["b"] == 3


def test_resolvers_nest(tmp_path):
    assert resolved(tmp_path, "a: ${add:1,${mul:2,${max:3,4}}}\n")["a"] == 9


def test_oc_env_reads_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GYMV_TEST_ADDR", "ray://head:10001")
    assert resolved(tmp_path, "a: ${oc.env:GYMV_TEST_ADDR}\n")["a"] == "ray://head:10001"


def test_oc_env_falls_back_to_the_default_and_null_means_none(tmp_path, monkeypatch):
    monkeypatch.delenv("GYMV_TEST_UNSET", raising=False)
    r = resolved(tmp_path, "a: ${oc.env:GYMV_TEST_UNSET,fallback}\nb: ${oc.env:GYMV_TEST_UNSET,null}\n")
    assert (r["a"], r["b"]) == ("fallback", None)


def test_oc_env_without_default_on_an_unset_variable_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("GYMV_TEST_UNSET", raising=False)
    with pytest.raises(GymvError, match="GYMV_TEST_UNSET is not set"):
        resolved(tmp_path, "a: ${oc.env:GYMV_TEST_UNSET}\n")


def test_a_reference_to_a_key_that_itself_interpolates_is_followed(tmp_path):
    assert resolved(tmp_path, "a: 2\nb: ${mul:${a},3}\nc: ${b}\n")["c"] == 6


def test_an_escaped_dollar_brace_stays_literal(tmp_path):
    assert resolved(tmp_path, "a: 'cost \\${not.a.ref}'\n")["a"] == "cost ${not.a.ref}"


def test_a_reference_to_a_missing_key_names_the_key_file_and_line_and_suggests(tmp_path):
    with pytest.raises(GymvError) as e:
        resolved(tmp_path, "grpo: {prompts_per_step: 8}\nn: ${grpo.prompt_per_step}\n")
    assert "r.yaml:2" in str(e.value) and "${grpo.prompt_per_step}" in str(e.value)
    assert "did you mean ${grpo.prompts_per_step}" in str(e.value)


def test_an_interpolation_cycle_is_reported_with_its_chain(tmp_path):
    with pytest.raises(GymvError, match=r"interpolation cycle: a -> b -> a"):
        resolved(tmp_path, "a: ${b}\nb: ${a}\n")


def test_a_key_referring_to_its_own_section_is_a_cycle(tmp_path):
    with pytest.raises(GymvError, match="interpolation cycle"):
        resolved(tmp_path, "a:\n  b: ${a}\n")


def test_an_unknown_resolver_is_an_error_with_a_suggestion(tmp_path):
    with pytest.raises(GymvError, match="unknown resolver `mull`.*did you mean `mul`"):
        resolved(tmp_path, "a: ${mull:1,2}\n")


def test_arithmetic_on_text_is_an_error_at_the_key(tmp_path):
    with pytest.raises(GymvError) as e:
        resolved(tmp_path, "x: abc\nn: ${add:${x},1}\n")
    assert "r.yaml:2" in str(e.value) and "'abc' is not a number" in str(e.value)


def test_an_unterminated_interpolation_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="unterminated"):
        resolved(tmp_path, "a: ${b\n")


def test_embedding_a_mapping_in_text_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="cannot be embedded in text"):
        resolved(tmp_path, "a: {b: 1}\nc: x-${a}\n")


def test_a_non_number_fed_to_arithmetic_by_an_override_is_blamed_on_the_override(tmp_path):
    with pytest.raises(GymvError, match=r"the value of \$\{a\}, written at <command line: a=abc>"):
        resolved(tmp_path, "a: 1\nb: ${mul:${a},2}\n", overrides=["a=abc"])


def test_relative_references_resolve_as_omegaconf_reads_them(tmp_path):
    r = resolved(tmp_path, """
        policy:
          model_name: m
          generation: {temperature: 0.7, val_temperature: "${.temperature}"}
          tokenizer: {name: "${..model_name}"}
          max_len: 64
          gen_len: "${.max_len}"
        """)
    assert r["policy"]["generation"]["val_temperature"] == 0.7
    assert (r["policy"]["tokenizer"]["name"], r["policy"]["gen_len"]) == ("m", 64)


def test_a_relative_reference_above_the_top_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(GymvError, match="`a.b` references \\$\\{...x\\}, which climbs above the top"):
        resolved(tmp_path, "a: {b: '${...x}'}\n")


def test_lint_reports_every_broken_interpolation_of_a_file(tmp_path):
    from gymv.config.lint import lint_paths

    p = write(tmp_path, "r.yaml", "algorithm: grpo\na: ${nope}\nb: ${nada.x}\nc: ${add:1,x}\nd: ${.ok}\nok: 1\n")
    found = [f for f in lint_paths([p]).findings if "interpolation" in f.check]
    assert sorted(f.line for f in found) == [2, 3, 4]
