"""Metric checks: boolean conditions over a run's logged metrics, parsed and evaluated without `eval`.

    from gymv.checks import parse_check, evaluate_checks
    results = evaluate_checks(["median(train/token_mult_prob_error) < 1.1"], "runs/my-run")
"""

from gymv.checks.evaluate import CheckEvalError, CheckResult, MetricSeries, Observed, evaluate_check, evaluate_checks
from gymv.checks.registry import KNOWN_METRICS, closest_metric, is_known_metric, known_metrics, register_metric
from gymv.checks.sources import BEGIN_CHECKS, END_CHECKS, CheckSource, driver_checks, recipe_checks
from gymv.checks.syntax import STATISTICS, Check, CheckError, CheckSyntaxError, parse_check

__all__ = [
    "BEGIN_CHECKS", "END_CHECKS", "KNOWN_METRICS", "STATISTICS", "Check", "CheckError", "CheckEvalError", "CheckResult",
    "CheckSource", "CheckSyntaxError", "MetricSeries", "Observed", "closest_metric", "driver_checks", "evaluate_check",
    "evaluate_checks", "is_known_metric", "known_metrics", "parse_check", "recipe_checks", "register_metric",
]
