"""Metric checks: the language parses what recipes write, evaluates it against a real metrics.jsonl, and refuses
anything that is not a statistic of a metric (no attributes, imports, strings, indexing, exponents)."""

from __future__ import annotations

import json

import pytest

from gymv.checks import (
    KNOWN_METRICS,
    CheckSyntaxError,
    MetricSeries,
    evaluate_check,
    evaluate_checks,
    is_known_metric,
    parse_check,
)
from gymv.runs.metrics import MetricsLog


@pytest.fixture
def run_dir(tmp_path):
    """A run directory whose metrics.jsonl the real writer filled: steps 1..5 (and a step-0 validation)."""
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        log.log(0, {"val/accuracy": 0.1})
        for step, (reward, err, acc) in enumerate(
                [(0.0, 1.02, 0.2), (0.1, 1.05, 0.4), (0.3, 1.04, 0.6), (0.4, 1.30, 0.8), (0.5, 1.01, 0.9)], 1):
            log.log(step, {"train/reward_mean": reward, "train/token_mult_prob_error": err, "train/accuracy": acc,
                           "train/loss": float("nan") if step == 2 else 1.0 / step})
    return tmp_path


def check(text: str, run_dir):
    return evaluate_check(text, MetricSeries.from_run(run_dir))


# -- the statistics ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("median(train/token_mult_prob_error) < 1.1", 1.04),
    ("mean(train/reward_mean) > 0", 0.26),
    ("min(train/accuracy) > 0", 0.2),
    ("max(train/accuracy) > 0", 0.9),
    ("ratio_above(train/accuracy, 0.5) > 0", 0.6),
])
def test_each_statistic_computes_over_every_logged_step(run_dir, text, value):
    r = check(text, run_dir)
    assert r.status == "pass"
    assert r.observed[0].value == pytest.approx(value)
    assert r.observed[0].count == 5


def test_last_n_takes_the_last_n_values(run_dir):
    r = check("mean(train/reward_mean, last=3) > 0.2", run_dir)
    assert (r.status, r.observed[0].value, r.observed[0].count) == ("pass", pytest.approx(0.4), 3)


def test_first_n_takes_the_first_n_values(run_dir):
    r = check("mean(train/reward_mean, first=2) > 0.2", run_dir)
    assert (r.status, r.observed[0].value) == ("fail", pytest.approx(0.05))


@pytest.mark.parametrize("steps, value", [("2:3", 0.2), ("4:", 0.45), (":2", 0.05), ("3", 0.3)])
def test_steps_selects_an_inclusive_range_of_step_numbers(run_dir, steps, value):
    assert check(f"mean(train/reward_mean, steps={steps}) >= 0", run_dir).observed[0].value == pytest.approx(value)


def test_steps_then_last_narrow_in_that_order(run_dir):
    assert check("mean(train/reward_mean, steps=1:4, last=2) > 0", run_dir).observed[0].value == pytest.approx(0.35)


def test_ratio_above_counts_values_strictly_above_the_threshold(run_dir):
    assert check("ratio_above(train/accuracy, 0.6) == 0.4", run_dir).status == "pass"


def test_a_step_zero_validation_row_is_part_of_the_series(run_dir):
    assert check("max(val/accuracy, steps=0) == 0.1", run_dir).status == "pass"


def test_values_are_a_metrics_values_in_step_order_without_its_nulls(run_dir):
    metrics = MetricSeries.from_run(run_dir)
    assert metrics.values("val/accuracy") == [v for _, v in metrics.series("val/accuracy")]
    assert len(metrics.values("train/loss")) == 4 and metrics.values("no/such_metric") == []


def test_null_values_are_skipped(run_dir):
    r = check("max(train/loss) <= 1", run_dir)
    assert r.observed[0].count == 4


# -- the language -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, status", [
    ("median(train/token_mult_prob_error) < 1.1 and mean(train/reward_mean, last=3) > 0.2", "pass"),
    ("median(train/token_mult_prob_error) > 1.1 or max(train/accuracy) >= 0.9", "pass"),
    ("not max(train/token_mult_prob_error) < 1.1", "pass"),
    ("0.2 < mean(train/reward_mean) < 0.3", "pass"),
    ("0.3 < mean(train/reward_mean) < 0.4", "fail"),
    ("(max(train/accuracy) - min(train/accuracy)) / 2 == 0.35", "pass"),
    ("-max(train/accuracy) + 1 * 2 > 1", "pass"),
    ("mean(`train/reward_mean`) != 0", "pass"),
])
def test_arithmetic_comparisons_and_logic_follow_python_precedence(run_dir, text, status):
    assert check(text, run_dir).status == status


def test_and_binds_tighter_than_or():
    tree = parse_check("max(train/loss) > 1 or max(train/loss) > 2 and max(train/loss) > 3").tree
    assert type(tree).__name__ == "BoolOp" and tree.op == "or" and tree.values[1].op == "and"


def test_metric_names_may_hold_slashes_underscores_dots_and_a_qualifier():
    names = [m.name for m in parse_check("max(train/reward_mean/circle_count) > max(x.y/qwen2.5_z)").metrics]
    assert names == ["train/reward_mean/circle_count", "x.y/qwen2.5_z"]


def test_a_failing_check_reports_its_observed_values(run_dir):
    r = check("median(train/token_mult_prob_error) < 1.03", run_dir)
    assert r.status == "fail"
    assert r.observed_text() == "median(train/token_mult_prob_error) = 1.04"


# -- evaluation errors ---------------------------------------------------------------------------------------


def test_a_metric_never_logged_is_an_error_suggesting_the_closest(run_dir):
    r = check("mean(train/reward_men) > 0", run_dir)
    assert r.status == "error" and "never logged" in r.error and "train/reward_mean" in r.error


def test_a_selection_with_no_values_is_an_error_not_a_pass(run_dir):
    r = check("mean(train/reward_mean, steps=9:) > 0", run_dir)
    assert r.status == "error" and "no values" in r.error and "steps 1..5" in r.error


def test_division_by_zero_is_an_error(run_dir):
    r = check("max(train/accuracy) / (min(train/accuracy) - 0.2) > 1", run_dir)
    assert r.status == "error" and "division by zero" in r.error


def test_arithmetic_beyond_the_magnitude_bound_is_an_error(run_dir):
    r = check("max(train/accuracy) * 1e15 * 1e15 * 1e15 * 1e15 * 1e15 * 1e15 * 1e15 > 1", run_dir)
    assert r.status == "error" and "out of range" in r.error


def test_a_run_without_metrics_yet_fails_every_check_with_a_reason(tmp_path):
    [r] = evaluate_checks(["mean(train/loss) < 1"], tmp_path)
    assert r.status == "error" and "no metrics yet" in r.error


def test_a_run_in_progress_with_a_truncated_last_line_is_read(run_dir):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "train/reward_mean": 9.0})[:20])
    assert check("max(train/reward_mean) == 0.5", run_dir).status == "pass"


# -- hostile and malformed input: refused by the parser, with the column -------------------------------------


@pytest.mark.parametrize("text, column, says", [
    ("mean(train/loss).__class__ > 1", 17, "attribute access"),
    ("__import__('os').system('true')", 1, "`__`"),
    ("mean(train/loss) < 'x'", 20, "strings are not allowed"),
    ("mean(train/loss)[0] < 1", 17, "indexing"),
    ("2 ** 99999999 > 1", 3, "exponent"),
    ("9 ^ 99999999 > 1", 3, "exponent"),
    ("mean(train/loss) < 1e999999", 20, "out of range"),
    ("mean(train/loss) < 1" + "0" * 60, 20, "too long"),
    ("open(train/loss) < 1", 1, "unknown function `open`"),
    ("exec(train/loss) < 1", 1, "unknown function `exec`"),
    ("lambda: 1", 7, "unexpected `:`"),
    ("mean(train/loss); 1 < 2", 17, "one expression"),
    ("train/loss < 1", 1, "must be inside a statistic"),
    ("mean(train/loss)", 1, "must be a condition"),
    ("mean(train/loss) < 1 and 3", 26, "`and` joins conditions"),
    ("mean(train/loss) <", 19, "the check ends"),
    ("mean(train/loss, last=0) < 1", 23, "at least 1"),
    ("mean(train/loss, last=2.5) < 1", 23, "whole number"),
    ("mean(train/loss, steps=5:2) < 1", 24, "empty"),
    ("mean(train/loss, every=2) < 1", 18, "unknown keyword `every`"),
    ("mean(train/loss, first=1, last=1) < 1", 27, "either first= or last="),
    ("mean(train/loss, last=1, last=2) < 1", 26, "given twice"),
    ("ratio_above(train/accuracy) > 0", 1, "takes 2 arguments"),
    ("mean(2) > 1", 6, "takes a metric name first"),
    ("mean(mean(train/loss)) > 1", 6, "takes a metric name first"),
    ("", 1, "empty"),
    ("((" * 20 + "1" + "))" * 20 + " < 2", 33, "nests more than"),
    ("- " * 40 + "mean(train/loss) < 1", 65, "nests more than"),
    ("mean(train/loss) < 1" + " " * 1000, 1001, "limit is"),
])
def test_hostile_or_malformed_checks_are_refused_with_their_column(text, column, says):
    with pytest.raises(CheckSyntaxError) as e:
        parse_check(text)
    assert says in e.value.reason
    assert e.value.pos + 1 == column
    assert f"at column {column}" in e.value.one_line()


def test_the_caret_points_at_the_offending_character():
    with pytest.raises(CheckSyntaxError) as e:
        parse_check("mean(train/loss) ** 2 < 1")
    assert e.value.caret() == "mean(train/loss) ** 2 < 1\n                 ^"


def test_a_refused_check_evaluates_to_an_error_not_an_exception(run_dir):
    r = check("2 ** 10 > 1", run_dir)
    assert r.status == "error" and "exponent" in r.error


def test_evaluation_never_calls_python_eval(run_dir, monkeypatch):
    import builtins

    def refuse(*a, **k):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert check("mean(train/reward_mean, last=3) > 0.2 and not 1 + 1 == 3", run_dir).status == "pass"


# -- the registry of metric names ---------------------------------------------------------------------------


def test_the_registry_holds_the_documented_metric_names():
    from conftest import REPO

    import re

    doc = (REPO / "docs" / "algorithms.md").read_text()
    section = doc.split("## 10. Metric names", 1)[1].split("## 11.", 1)[0]
    documented = set(re.findall(r"`((?:train|val|timing|async)/[a-z_]+)`", section))
    assert documented - KNOWN_METRICS == set()


def test_nemo_rls_importance_sampling_metric_is_known():
    assert is_known_metric("train/is_oob_ratio")


def test_every_bin_of_the_staleness_histogram_is_known():
    assert is_known_metric("async/age_0_fraction") and is_known_metric("async/age_12_fraction")
    assert not is_known_metric("async/age_x_fraction")


def test_a_per_environment_qualifier_of_a_known_metric_is_known():
    assert is_known_metric("train/reward_mean/circle_count_simple_agent")
    assert not is_known_metric("train/reward_meen/circle_count")


def test_every_metric_name_the_engine_writes_literally_is_known():
    """A metric the training code logs under a literal name must be checkable without a GV021 finding."""
    import re

    from conftest import REPO

    written = set()
    for path in (REPO / "gymv").rglob("*.py"):
        if "checks" not in path.parts:
            written |= set(re.findall(r"[\"']((?:train|val|timing|async)/[a-z_]+[a-z])[\"']", path.read_text()))
    assert {n for n in written if not is_known_metric(n)} == set()
