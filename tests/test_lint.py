"""`gymv lint` rules: each fires on a planted violation, at the right file and line, and not on clean input."""

from __future__ import annotations

import re

import pytest

from gymv.backends.registry import REFIT_TRANSPORTS, TransportCapabilities
from gymv.config.compat import RULES as COMPAT_RULES
from gymv.config.lint import RULES, LintFinding, lint_paths, rule_id
from conftest import REPO
from lint_tree import Tree, block


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    monkeypatch.chdir(tmp_path)
    return Tree(tmp_path)


def lint(*paths: str) -> list[LintFinding]:
    return lint_paths(paths or ["recipes"]).findings


def hits(findings: list[LintFinding], rule: str) -> list[str]:
    """`path:line` of each finding of `rule`."""
    return [f"{f.path}:{f.line}" for f in findings if f.rule == rule]


def rules(findings: list[LintFinding]) -> set[str]:
    return {f.rule for f in findings}


# -- clean input ------------------------------------------------------------------------------------


def test_the_repository_recipes_are_clean(monkeypatch):
    monkeypatch.chdir(REPO)
    assert [f.one_line() for f in lint("recipes")] == []


def test_the_clean_fixture_tree_has_no_finding(tree):
    assert [f.one_line() for f in lint()] == []


# -- the registry -----------------------------------------------------------------------------------


def test_rule_ids_are_unique_and_numbered_gv001_upwards():
    ids = [r.id for r in RULES]
    assert ids == [f"GV{i:03d}" for i in range(1, len(ids) + 1)]


def test_every_compatibility_rule_maps_to_gv007():
    assert {rule_id(r.id) for r in COMPAT_RULES} == {"GV007"}


def test_docs_lint_md_lists_every_rule_id():
    docs = (REPO / "docs" / "lint.md").read_text()
    assert [r.id for r in RULES if not re.search(rf"^\| {r.id} \|", docs, re.M)] == []


# -- GV001: the recipe loads ------------------------------------------------------------------------


@pytest.mark.parametrize("text, line, says", [
    ("defaults: ../grpo.yaml\nseed: 7\ngrpo:\n  max_steps: [1, 2\n", 5, "YAML syntax error"),
    ("defaults: ../grpo.yaml\nseed: 7\nseed: 8\n", 3, "duplicate key"),
    ("- just\n- a list\n", 1, "must be a mapping"),
    ("# parent\ndefaults:\n  - ../nowhere.yaml\nseed: 7\n", 3, "not found"),
    ("defaults: ../grpo.yaml\n_override_: true\n", 2, "_override_"),
])
def test_a_file_that_does_not_load_is_gv001_at_its_line(tree, text, line, says):
    tree.write("llm/grpo-tiny-1n0g-torch.yaml", text)
    [f] = [f for f in lint() if f.rule == "GV001"]
    assert (f.path, f.line) == ("recipes/llm/grpo-tiny-1n0g-torch.yaml", line) and says in f.message


def test_a_defaults_cycle_is_gv001_naming_the_chain(tree):
    tree.write("llm/grpo-tiny-1n0g-torch.yaml", "defaults: grpo-b-1n0g-torch.yaml\nseed: 7\n")
    tree.add("llm/grpo-b-1n0g-torch.yaml", "defaults: grpo-tiny-1n0g-torch.yaml\nseed: 9\n")
    found = [f for f in lint() if f.rule == "GV001"]
    assert found and all("cycle" in f.message and f.line == 1 for f in found)


# -- GV002: inherits the exemplar -------------------------------------------------------------------


def test_a_recipe_without_defaults_is_gv002(tree):
    text = (tree.root / "grpo.yaml").read_text()
    tree.write("llm/grpo-tiny-1n0g-torch.yaml", text.replace("seed: 42 ", "seed: 7  "))
    assert hits(lint(), "GV002") == ["recipes/llm/grpo-tiny-1n0g-torch.yaml:1"]


def test_a_chain_that_misses_the_algorithms_exemplar_is_gv002(tree):
    tree.write("vlm/vlm_grpo-tiny-1n0g-torch.yaml", "defaults: ../vlm_grpo.yaml\nalgorithm: vlm_sft\nseed: 8\n"
               "grpo: null\nsft: {}\n")
    found = [f for f in lint() if f.rule == "GV002"]
    assert [f.path for f in found] == ["recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml"] and "sft.yaml" in found[0].message


def test_an_exemplar_with_defaults_is_gv002(tree):
    tree.write("grpo.yaml", "defaults: vlm_grpo.yaml\n" + (tree.root / "grpo.yaml").read_text())
    assert "recipes/grpo.yaml:1" in hits(lint(), "GV002")


# -- GV003: minimal ---------------------------------------------------------------------------------


def test_a_leaf_equal_to_the_inherited_value_is_gv003_at_its_line(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "model:\n  dtype: auto\n")
    assert hits(lint(), "GV003") == [f"recipes/llm/grpo-tiny-1n0g-torch.yaml:{tree.line_of('llm/grpo-tiny-1n0g-torch.yaml', 'dtype')}"]


# -- GV004, GV005: the name -------------------------------------------------------------------------


def test_a_name_with_an_unknown_algorithm_prefix_is_gv004(tree):
    tree.add("llm/ppo-tiny-1n0g-torch.yaml", "defaults: ../grpo.yaml\nseed: 9\n")
    found = lint()
    assert rules(found) == {"GV004"} and "'ppo' is not an algorithm" in found[0].message


def test_a_name_whose_gpus_disagree_with_the_cluster_is_gv005_on_the_recipe(tree):
    tree.add("llm/grpo-tiny-1n8g-torch.yaml", "defaults: ../grpo.yaml\nseed: 9\n", gpus=8)
    found = lint()
    assert rules(found) == {"GV005"}
    [f] = found
    assert (f.path, f.line) == ("recipes/llm/grpo-tiny-1n8g-torch.yaml", 1)
    assert "gpus_per_node 8" in f.message and "recipes/grpo.yaml:" in f.message


def test_a_name_that_disagrees_with_a_key_the_recipe_writes_is_reported_at_that_key(tree):
    tree.add("llm/grpo-tiny-2n0g-torch.yaml", "defaults: ../grpo.yaml\ncluster:\n  num_nodes: 3\n", nodes=2)
    assert hits(lint(), "GV005") == ["recipes/llm/grpo-tiny-2n0g-torch.yaml:3"]


# -- GV006: schema ----------------------------------------------------------------------------------


def test_an_unknown_key_is_gv006_at_its_line_with_a_suggestion(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "grpo:\n  loss:\n    clip_lo: 0.1\n")
    [f] = lint()
    assert (f.rule, f.line, f.fix) == ("GV006", 7, "did you mean `grpo.loss.clip_low`?")


def test_a_value_of_the_wrong_type_is_gv006_at_its_line(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "grpo:\n  max_steps: many\n")
    assert hits(lint(), "GV006") == ["recipes/llm/grpo-tiny-1n0g-torch.yaml:6"]


def test_a_broken_interpolation_is_gv006(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "name: run-${sed}\n")
    [f] = lint()
    assert (f.rule, f.line) == ("GV006", 5) and "${sed}" in f.message


def test_an_error_in_a_parent_recipe_is_reported_once_at_the_parent(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "grpo:\n  loss:\n    clip_lo: 0.1\n")
    tree.add("llm/grpo-tiny-1n0g-torch-v2.yaml", "defaults: grpo-tiny-1n0g-torch.yaml\nseed: 3\n")
    assert hits(lint(), "GV006") == ["recipes/llm/grpo-tiny-1n0g-torch.yaml:7"]


# -- GV007: compatibility ---------------------------------------------------------------------------


class CarrierPigeonSender:
    """A plugin transport that declares it leaves the vision encoder's cache alone."""

    capabilities = TransportCapabilities(resets_encoder_cache=False, lag_safe=True)


@pytest.fixture
def no_reset_transport():
    REFIT_TRANSPORTS.register("carrier_pigeon", CarrierPigeonSender)
    yield "carrier_pigeon"
    REFIT_TRANSPORTS.unregister("carrier_pigeon")


def test_encoder_cache_reset_with_a_transport_that_cannot_is_gv007(tree, no_reset_transport):
    tree.append("vlm/vlm_grpo-tiny-1n0g-torch.yaml", f"refit:\n  transport: {no_reset_transport}\n")  # the flag is on by default
    [f] = lint()
    assert (f.rule, f.check, f.path) == ("GV007", "refit.encoder-cache-reset", "recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml")


def test_async_without_importance_sampling_is_gv007_on_the_recipe_that_enables_it(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "grpo:\n  async:\n    enabled: true\n")
    [f] = lint()
    assert (f.rule, f.check, f.path, f.line) == ("GV007", "async.importance-sampling", "recipes/llm/grpo-tiny-1n0g-torch.yaml", 1)
    assert "recipes/grpo.yaml:" in f.message


def test_parallel_sizes_that_do_not_divide_the_gpus_are_gv007(tree):
    text = Tree.GPU_RECIPE.replace("backend: megatron\n", "backend: megatron\n  parallel:\n    tensor: 3\n")
    tree.add("llm/grpo-big-1n8g-megatron.yaml", text, gpus=8, suite=None)
    tree.disable("llm/grpo-big-1n8g-megatron.yaml")
    [f] = lint()
    assert (f.rule, f.check, f.line) == ("GV007", "parallel.divides-gpus", 4)


def test_a_gpu_recipe_whose_parallel_sizes_divide_its_gpus_is_clean(tree):
    text = Tree.GPU_RECIPE.replace("backend: megatron\n", "backend: megatron\n  parallel:\n    tensor: 2\n")
    tree.add("llm/grpo-big-1n8g-megatron.yaml", text, gpus=8, suite=None)
    tree.disable("llm/grpo-big-1n8g-megatron.yaml")
    assert lint() == []


def test_a_recipe_gymv_train_cannot_run_on_a_run_suite_is_gv022_at_its_entry(tree):
    # megatron runs no pipeline parallelism: what gymv train cannot run
    text = Tree.GPU_RECIPE.replace("backend: megatron\n", "backend: megatron\n  parallel:\n    pipeline: 2\n")
    tree.add("llm/grpo-big-1n8g-megatron.yaml", text, gpus=8, minutes=1)
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV022", "recipes/suites/nightly.txt", tree.line_of("suites/nightly.txt", "grpo-big"))
    assert "training.backend" in f.message and "disabled.txt" in f.fix


def test_the_same_recipe_in_disabled_with_a_reason_is_clean(tree):
    tree.add("llm/grpo-big-1n8g-megatron.yaml", Tree.GPU_RECIPE, gpus=8, suite=None)
    tree.disable("llm/grpo-big-1n8g-megatron.yaml")
    assert lint() == []


# -- GV008 .. GV013: the 1:1:1 rule and suite lists -------------------------------------------------


def test_a_recipe_without_a_driver_is_gv008(tree):
    (tree.root / "drivers/llm/grpo-tiny-1n0g-torch.sh").unlink()
    assert hits(lint(), "GV008") == ["recipes/llm/grpo-tiny-1n0g-torch.yaml:1"]


def test_a_driver_without_a_recipe_is_gv009(tree):
    tree.driver("llm/gone-1n0g-torch.yaml", block())
    assert hits(lint(), "GV009") == ["recipes/drivers/llm/gone-1n0g-torch.sh:1"]


def test_a_recipe_in_no_suite_is_gv010(tree):
    tree.add("llm/grpo-other-1n0g-torch.yaml", "defaults: ../grpo.yaml\nseed: 9\n", suite=None)
    assert hits(lint(), "GV010") == ["recipes/llm/grpo-other-1n0g-torch.yaml:1"]


def test_a_recipe_in_two_suites_is_gv011_at_the_second_entry(tree):
    tree.append("suites/release.txt", "llm/grpo-tiny-1n0g-torch.yaml\n")
    tree.write("suites/gpus_per_node.yaml", "nightly: [0, 8]\nrelease: [0, 8]\n")
    assert hits(lint(), "GV011") == ["recipes/suites/release.txt:2"]


def test_a_recipe_listed_twice_in_one_suite_is_gv011(tree):
    tree.append("suites/nightly.txt", "recipes/llm/grpo-tiny-1n0g-torch.yaml\n")
    assert hits(lint(), "GV011") == ["recipes/suites/nightly.txt:4"]


def test_a_suite_entry_naming_no_recipe_is_gv012(tree):
    tree.append("suites/nightly.txt", "llm/nothing-here.yaml\n")
    assert hits(lint(), "GV012") == ["recipes/suites/nightly.txt:4"]


def test_a_disabled_entry_without_a_reason_is_gv013_and_with_one_is_clean(tree):
    tree.add("llm/grpo-off-1n0g-torch.yaml", "defaults: ../grpo.yaml\nseed: 9\n", suite=None)
    tree.append("suites/disabled.txt", "llm/grpo-off-1n0g-torch.yaml  # flaky, see issue 3\n")
    assert lint() == []
    tree.write("suites/disabled.txt", "llm/grpo-off-1n0g-torch.yaml\n")
    assert hits(lint(), "GV013") == ["recipes/suites/disabled.txt:1"]


# -- GV014: the driver's CONFIG block ---------------------------------------------------------------


@pytest.mark.parametrize("body, needle, says", [
    (f"# ===== BEGIN CONFIG =====\n{block()}\necho run\n", "BEGIN CONFIG", "no END marker"),
    ("echo no block here\n", None, "no CONFIG block"),
    ("# ===== BEGIN CONFIG =====\n" + block().replace("NUM_MINUTES=30", "NUM_MINUTES=$(date +%M)")
     + "# ===== END CONFIG =====\n", "NUM_MINUTES", "$(...)"),
    ("# ===== BEGIN CONFIG =====\n" + block().replace("MAX_STEPS=10", "MAX_STEPS=$STEPS") + "# ===== END CONFIG =====\n",
     "MAX_STEPS", "STEPS"),
])
def test_an_unreadable_driver_block_is_gv014_at_its_line(tree, body, needle, says):
    path = tree.write("drivers/llm/grpo-tiny-1n0g-torch.sh", "#!/usr/bin/env bash\n" + body)
    [f] = lint()
    line = 1 if needle is None else next(i for i, t in enumerate(path.read_text().splitlines(), 1) if needle in t)
    assert (f.rule, f.path, f.line) == ("GV014", "recipes/drivers/llm/grpo-tiny-1n0g-torch.sh", line) and says in f.message


# -- GV015, GV016: the driver agrees with its recipe and its suite ----------------------------------


def test_a_driver_whose_nodes_disagree_with_the_name_is_gv015_at_the_assignment(tree):
    tree.driver("llm/grpo-tiny-1n0g-torch.yaml", block(nodes=2))
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV015", "recipes/drivers/llm/grpo-tiny-1n0g-torch.sh", 5)
    assert "NUM_NODES=2" in f.message and "1n0g" in f.message


def test_a_driver_that_leaves_gpus_per_node_to_its_default_of_8_disagrees_with_a_1n0g_name(tree):
    tree.driver("llm/grpo-tiny-1n0g-torch.yaml", block().replace("GPUS_PER_NODE=0\n", ""))
    [f] = lint()
    assert (f.rule, f.line) == ("GV015", 4) and "GPUS_PER_NODE=8" in f.message


def test_a_driver_whose_gpus_per_node_is_not_its_suites_is_gv016(tree):
    tree.write("suites/nightly.txt", "llm/grpo-tiny-1n0g-torch.yaml\n")
    tree.write("suites/release.txt", "vlm/vlm_grpo-tiny-1n0g-torch.yaml\n")
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV016", "recipes/drivers/vlm/vlm_grpo-tiny-1n0g-torch.sh", 6)
    assert "suite release runs on nodes of 8 GPUs (recipes/suites/gpus_per_node.yaml:2)" in f.message


# -- GV017, GV018: budgets and suite files ----------------------------------------------------------


def test_a_suite_over_its_budget_is_gv017_at_its_budget_line(tree):
    tree.add("llm/grpo-big-1n8g-fsdp2.yaml", Tree.RUNNABLE_GPU_RECIPE, gpus=8, minutes=120)
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV017", "recipes/suites/budgets.yaml", 1)
    assert f.message == "suite nightly needs 16.00 GPU-hours, over its budget of 10.00"


def test_a_suite_within_its_budget_is_clean(tree):
    tree.add("llm/grpo-big-1n8g-fsdp2.yaml", Tree.RUNNABLE_GPU_RECIPE, gpus=8, minutes=120)
    tree.write("suites/budgets.yaml", "nightly: 16\nrelease: 100\n")
    assert lint() == []


@pytest.mark.parametrize("rel, text, line", [
    ("suites/budgets.yaml", "nightly: lots\n", 1),
    ("suites/budgets.yaml", "nightly: [1\n", 2),
    ("suites/gpus_per_node.yaml", "nightly: [0, 8]\nrelease: eight\n", 2),
    ("suites/nightly.txt", "llm/grpo-tiny-1n0g-torch.yaml vlm/vlm_grpo-tiny-1n0g-torch.yaml\n", 1),
])
def test_an_unreadable_suite_file_is_gv018_at_its_line(tree, rel, text, line):
    tree.write(rel, text)
    assert f"recipes/{rel}:{line}" in hits(lint(), "GV018")


# -- GV019: wrapper values --------------------------------------------------------------------------


def test_a_wrapper_value_that_never_reaches_the_driver_it_execs_is_a_gv019_warning(tree):
    tree.add("llm/grpo-tiny-1n0g-torch-v2.yaml", "defaults: grpo-tiny-1n0g-torch.yaml\nseed: 3\n")
    tree.driver("llm/grpo-tiny-1n0g-torch-v2.yaml", block().replace("NUM_MINUTES=30", "NUM_MINUTES=90"),
                after='exec "$(dirname "$0")/grpo-tiny-1n0g-torch.sh" "$@"\n')
    [f] = lint()
    assert (f.rule, f.severity, f.path, f.line) == ("GV019", "warning", "recipes/drivers/llm/grpo-tiny-1n0g-torch-v2.sh", 9)


# -- scope ------------------------------------------------------------------------------------------


def test_linting_one_recipe_reports_its_own_findings_only(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "model:\n  dtype: auto\n")
    tree.append("vlm/vlm_grpo-tiny-1n0g-torch.yaml", "model:\n  dtype: auto\n")
    assert [f.path for f in lint("recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml")] == ["recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml"]


def test_linting_one_recipe_includes_its_duplicate_suite_entry(tree):
    tree.append("suites/nightly.txt", "llm/grpo-tiny-1n0g-torch.yaml\n")
    assert hits(lint("recipes/llm/grpo-tiny-1n0g-torch.yaml"), "GV011") == ["recipes/suites/nightly.txt:4"]
    assert lint("recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml") == []


def test_linting_one_recipe_reports_an_unreadable_budgets_file(tree):
    tree.write("suites/budgets.yaml", "nightly: lots\n")
    assert hits(lint("recipes/vlm/vlm_grpo-tiny-1n0g-torch.yaml"), "GV018") == ["recipes/suites/budgets.yaml:1"]


def test_linting_a_driver_lints_its_recipe(tree):
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "model:\n  dtype: auto\n")
    assert rules(lint("recipes/drivers/llm/grpo-tiny-1n0g-torch.sh")) == {"GV003"}


def test_findings_are_sorted_by_path_then_line(tree):
    tree.append("vlm/vlm_grpo-tiny-1n0g-torch.yaml", "model:\n  dtype: auto\n")
    tree.append("llm/grpo-tiny-1n0g-torch.yaml", "grpo:\n  max_steps: many\nmodel:\n  dtype: auto\n")
    found = lint()
    assert [(f.path, f.line) for f in found] == sorted((f.path, f.line) for f in found) and len(found) == 3


def test_a_recipe_outside_any_recipes_directory_gets_the_config_rules_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("algorithm: grpo\ngrpo:\n  max_step: 3\n")
    [f] = lint("mine.yaml")
    assert (f.rule, f.path, f.line) == ("GV006", "mine.yaml", 3)


def test_one_finding_renders_as_path_line_id_message_fix():
    f = LintFinding("recipes/llm/x.yaml", 4, "GV003", "`seed` repeats the inherited value 42", "delete it")
    assert f.one_line() == "recipes/llm/x.yaml:4: GV003 `seed` repeats the inherited value 42 (fix: delete it)"
