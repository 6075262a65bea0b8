"""`gymv lint` on metric checks: GV020 for a check that does not parse, GV021 for an unknown metric, each at the
line that wrote it with the column in the message, in recipes and in drivers' CHECKS blocks."""

from __future__ import annotations

import pytest

from gymv.checks import BEGIN_CHECKS, END_CHECKS, driver_checks, register_metric
from gymv.checks import registry
from gymv.config.lint import LintFinding, lint_paths
from gymv.errors import GymvError
from lint_tree import Tree, block

RECIPE = "llm/grpo-tiny-1n0g-torch.yaml"
DRIVER = "drivers/llm/grpo-tiny-1n0g-torch.sh"


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    monkeypatch.chdir(tmp_path)
    return Tree(tmp_path)


def lint(*paths: str) -> list[LintFinding]:
    return lint_paths(paths or ["recipes"]).findings


def with_checks(tree: Tree, *checks: str) -> None:
    items = "".join(f"  - {c!r}\n" if "'" not in c else f'  - "{c}"\n' for c in checks)
    tree.append(RECIPE, "checks:\n" + items)


def test_valid_checks_over_known_metrics_are_clean(tree):
    with_checks(tree, "median(train/token_mult_prob_error) < 1.1", "mean(train/reward_mean, last=3) > 0.2",
                "ratio_above(train/accuracy/circle_count, 0.5, steps=2:) >= 0.6")
    assert [f.one_line() for f in lint()] == []


def test_a_check_that_does_not_parse_is_gv020_at_its_line_with_the_column(tree):
    with_checks(tree, "mean(train/loss) < 1", "mean(train/loss) ** 2 < 1")
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV020", "recipes/" + RECIPE, tree.line_of(RECIPE, "**"))
    assert "at column 18" in f.message and "exponent" in f.message


def test_an_unknown_metric_is_gv021_with_the_closest_known_name(tree):
    with_checks(tree, "mean(train/reward_men, last=3) > 0.2")
    [f] = lint()
    assert (f.rule, f.line) == ("GV021", tree.line_of(RECIPE, "reward_men"))
    assert "unknown metric `train/reward_men` at column 6" in f.message
    assert "train/reward_mean" in f.fix


def test_a_registered_plugin_metric_is_known(tree, monkeypatch):
    monkeypatch.setattr(registry, "_registered", set())
    with_checks(tree, "mean(train/my_plugin_score) > 0")
    assert [f.rule for f in lint()] == ["GV021"]
    register_metric("train/my_plugin_score")
    assert lint() == []


def test_a_bad_check_inherited_from_a_parent_is_reported_once_at_the_parent(tree):
    tree.write("llm/base.yaml", "defaults: ../grpo.yaml\nchecks:\n  - max(train/nope) < 1\n")
    tree.write(RECIPE, "defaults: base.yaml\nseed: 7\n")
    found = [(f.rule, f.path, f.line) for f in lint() if f.rule.startswith("GV02")]
    assert found == [("GV021", "recipes/llm/base.yaml", 3)]


def driver_with_checks(tree: Tree, lines: str) -> None:
    tree.driver(RECIPE, block(), after=f"{BEGIN_CHECKS}\n{lines}{END_CHECKS}\nexec gymv train x\n")


def test_driver_checks_are_read_from_their_comment_block_with_lines_and_columns(tree):
    driver_with_checks(tree, "# median(train/token_mult_prob_error) < 1.1\n#\n#   mean(train/reward_mean, last=5) > 0.3\n")
    found = driver_checks(tree.root / DRIVER)
    assert [(c.text, c.where.rsplit(":", 1)[1], c.column) for c in found] == [
        ("median(train/token_mult_prob_error) < 1.1", str(tree.line_of(DRIVER, "median")), 3),
        ("mean(train/reward_mean, last=5) > 0.3", str(tree.line_of(DRIVER, "last=5")), 5),
    ]
    assert lint() == []


def test_a_bad_driver_check_is_gv020_at_the_driver_line(tree):
    driver_with_checks(tree, "# mean(train/loss) < 1 +\n")
    [f] = lint()
    assert (f.rule, f.path, f.line) == ("GV020", "recipes/" + DRIVER, tree.line_of(DRIVER, "< 1 +"))


def test_an_unknown_metric_in_a_driver_check_is_gv021(tree):
    driver_with_checks(tree, "# max(timing/stp_s) < 60\n")
    [f] = lint(f"recipes/{DRIVER}")
    assert f.rule == "GV021" and "timing/step_s" in f.fix


def test_a_non_comment_line_inside_the_checks_block_is_gv020(tree):
    driver_with_checks(tree, "median(train/token_mult_prob_error) < 1.1\n")
    [f] = lint()
    assert f.rule == "GV020" and "not a comment" in f.message


def test_a_checks_block_without_its_end_marker_is_an_error_at_the_begin_line(tree):
    tree.driver(RECIPE, block(), after=f"{BEGIN_CHECKS}\n# max(train/loss) < 1\nexec gymv train x\n")
    with pytest.raises(GymvError) as e:
        driver_checks(tree.root / DRIVER)
    assert e.value.where.endswith(f":{tree.line_of(DRIVER, 'BEGIN CHECKS')}")
