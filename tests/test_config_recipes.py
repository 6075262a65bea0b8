"""The repository's recipes: every one loads, validates, is minimal, is named for what it runs, reaches its
exemplar, has one driver that agrees with it, and sits in exactly one suite within budget."""

from __future__ import annotations

import re

import pytest

from gymv.config import (
    ALGORITHMS,
    EXEMPLARS,
    MODELS,
    check_inherits_exemplar,
    check_minimal,
    check_recipe_name,
    default_recipes_root,
    exemplar_paths,
    load_recipe,
    parse_recipe_name,
    recipe_files,
    schema_keys,
    suite_accounting,
)

ROOT = default_recipes_root()
RECIPES = recipe_files(ROOT)
EXEMPLAR_FILES = exemplar_paths(ROOT)


def ids(paths):
    return [p.relative_to(ROOT).as_posix() for p in paths]


def test_there_are_at_least_eight_recipes_under_llm_and_vlm():
    assert len(RECIPES) >= 8 and {p.parent.name for p in RECIPES} == {"llm", "vlm"}


def test_every_algorithm_maps_to_an_existing_exemplar():
    assert set(EXEMPLARS) == set(ALGORITHMS)
    assert all((ROOT / name).is_file() for name in EXEMPLARS.values())


@pytest.mark.parametrize("path", RECIPES + EXEMPLAR_FILES, ids=ids(RECIPES + EXEMPLAR_FILES))
def test_recipe_loads_and_validates_with_no_finding(path):
    loaded = load_recipe(path)
    assert loaded.findings() == []
    assert loaded.validated.name == path.stem


@pytest.mark.parametrize("path", RECIPES, ids=ids(RECIPES))
def test_recipe_smoke_overrides_also_validate(path):
    assert load_recipe(path, smoke=True).validated


@pytest.mark.parametrize("path", RECIPES, ids=ids(RECIPES))
def test_recipe_is_minimal(path):
    assert [f.one_line() for f in check_minimal(load_recipe(path))] == []


@pytest.mark.parametrize("path", RECIPES + EXEMPLAR_FILES, ids=ids(RECIPES + EXEMPLAR_FILES))
def test_recipe_reaches_the_exemplar_of_its_algorithm(path):
    assert check_inherits_exemplar(load_recipe(path), ROOT) == []


@pytest.mark.parametrize("path", RECIPES, ids=ids(RECIPES))
def test_recipe_name_agrees_with_algorithm_cluster_and_backend(path):
    loaded = load_recipe(path)
    assert check_recipe_name(path, loaded.validated, loaded.locate) == []


@pytest.mark.parametrize("path", EXEMPLAR_FILES, ids=ids(EXEMPLAR_FILES))
def test_exemplar_writes_every_schema_key(path):
    loaded = load_recipe(path)
    written = {re.sub(r"^mopd\.teachers\.[^.]+", "mopd.teachers.<alias>", k) for k in loaded.tree.keys()}
    assert set(schema_keys(MODELS[loaded.validated.algorithm])) - written == set()


@pytest.mark.parametrize("path", EXEMPLAR_FILES, ids=ids(EXEMPLAR_FILES))
def test_exemplar_comments_every_key(path):
    key_line = re.compile(r"^\s*[\w.-]+:")
    bare = [f"{path.name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if key_line.match(line) and "#" not in line]
    assert bare == []


def test_the_1_1_1_rule_holds_recipes_drivers_and_suites():
    assert [f.one_line() for f in suite_accounting(ROOT)] == []


@pytest.mark.parametrize("path", RECIPES, ids=ids(RECIPES))
def test_driver_sizes_agree_with_the_recipe_cluster(path):
    from gymv.recipes import driver_for_recipe, parse_driver

    rel = path.relative_to(ROOT).as_posix()
    driver = parse_driver(driver_for_recipe(ROOT, rel))
    cluster = load_recipe(path).validated.cluster
    assert (driver.num_nodes, driver.gpus_per_node) == (cluster.num_nodes, cluster.gpus_per_node)


@pytest.mark.parametrize("path", RECIPES, ids=ids(RECIPES))
def test_driver_trains_its_own_recipe(path):
    from gymv.recipes import driver_for_recipe

    rel = path.relative_to(ROOT).as_posix()
    assert f"recipes/{rel}" in driver_for_recipe(ROOT, rel).read_text()


def test_one_wrapper_driver_execs_another_which_defaults_its_values():
    from gymv.recipes import parse_driver

    chains = [parse_driver(d).chain for d in sorted((ROOT / "drivers").rglob("*.sh"))]
    wrapped = [c for c in chains if len(c) > 1]
    assert wrapped
    assert 'NUM_NODES="${NUM_NODES:-' in wrapped[0][1].read_text()


def test_every_suite_is_within_its_budget():
    from gymv.recipes import plan

    groups = plan((), ROOT).groups
    assert {g.suite for g in groups} >= {"nightly", "release"}
    assert [(g.suite, float(g.gpu_hours), float(g.budget)) for g in groups if g.over_budget] == []


@pytest.mark.parametrize("name, expected", [
    ("grpo-qwen3-1.7b-1n8g-megatron.yaml", ("grpo", "qwen3-1.7b", 1, 8, "megatron", (), None)),
    ("vlm_grpo-qwen2.5-vl-7b-1n8g-megatron-async-1off", ("vlm_grpo", "qwen2.5-vl-7b", 1, 8, "megatron", ("async", "1off"), None)),
    ("sft-llama3.1-8b-2n8g-torch.v2.yaml", ("sft", "llama3.1-8b", 2, 8, "torch", (), 2)),
    ("vlm_sft-tinyllava-1n0g-torch", ("vlm_sft", "tinyllava", 1, 0, "torch", (), None)),
])
def test_recipe_names_parse(name, expected):
    n = parse_recipe_name(name)
    assert (n.algorithm, n.model, n.num_nodes, n.gpus_per_node, n.strategy, n.modifiers, n.version) == expected


@pytest.mark.parametrize("name, why", [
    ("ppo-llama-1n8g-torch", "not an algorithm"), ("grpo-llama-8g-torch", "does not match"),
    ("grpo-llama-1n8g-fsdp", "strategy 'fsdp'"), ("grpo-1n8g-torch", "does not match"),
])
def test_bad_recipe_names_say_what_is_wrong(name, why):
    with pytest.raises(ValueError, match=why):
        parse_recipe_name(name)


def test_a_name_that_disagrees_with_the_cluster_is_reported_at_the_key(tmp_path):
    p = tmp_path / "grpo-tiny-2n8g-fsdp2.yaml"
    p.write_text("algorithm: grpo\ntraining:\n  backend: fsdp2\ncluster:\n  gpus_per_node: 8\n")
    loaded = load_recipe(p)
    [f] = check_recipe_name(p, loaded.validated, loaded.locate)
    assert f.key == "cluster.num_nodes" and "2" in f.message and f.where.endswith(":4")


def test_docs_describe_every_schema_key_and_every_rule():
    from gymv.config import RULES

    docs = (ROOT.parent / "docs" / "config.md").read_text()
    keys = {k for m in MODELS.values() for k in schema_keys(m)}
    assert sorted(k for k in keys if f"`{k}`" not in docs) == []
    assert [r.id for r in RULES if f"`{r.id}`" not in docs] == []
