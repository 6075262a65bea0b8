"""Lint findings for checks: a check that does not parse (`check.syntax`), or names a metric gymv never
logs (`check.metric`). `gymv lint` maps them to GV020 and GV021."""

from __future__ import annotations

from collections.abc import Iterable

from gymv.checks.registry import closest_metric, is_known_metric
from gymv.checks.sources import CheckSource, driver_checks, recipe_checks
from gymv.checks.syntax import CheckSyntaxError, parse_check
from gymv.errors import GymvError
from gymv.findings import Finding


def check_findings(sources: Iterable[CheckSource], key: str | None = "checks") -> list[Finding]:
    out: list[Finding] = []
    for src in sources:
        try:
            check = parse_check(src.text)
        except CheckSyntaxError as e:
            out.append(Finding("check.syntax", f"check `{src.text}`: {e.reason} at column {e.pos + 1}", key,
                               src.where, e.fix))
            continue
        for m in check.metrics:
            if is_known_metric(m.name):
                continue
            near = closest_metric(m.name)
            fix = (f"did you mean `{near}`?" if near else
                   "use a metric gymv logs (docs/algorithms.md §10), or register a plugin's metric with "
                   "gymv.checks.register_metric")
            out.append(Finding("check.metric", f"check `{src.text}`: unknown metric `{m.name}` at column {m.pos + 1}",
                               key, src.where, fix))
    return out


def recipe_check_findings(rec) -> list[Finding]:
    """Findings for the `checks:` of a loaded recipe (only its text entries: the schema reports the rest)."""
    checks = rec.raw.get("checks")
    if not isinstance(checks, list):
        return []
    sources = [s for s, raw in zip(recipe_checks(rec), checks) if isinstance(raw, str)]
    return check_findings(sources)


def driver_check_findings(path) -> list[Finding]:
    """Findings for a driver's CHECKS block; a malformed block is one `check.syntax` finding at its line."""
    try:
        sources = driver_checks(path)
    except GymvError as e:
        return [Finding("check.syntax", e.message, None, e.where, e.fix)]
    return check_findings(sources, key=None)
