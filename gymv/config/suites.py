"""The 1:1:1 rule: every recipe has one driver and sits in exactly one suite (suite files are read by gymv.recipes)."""

from __future__ import annotations

import os
from pathlib import Path

from gymv.config.exemplars import default_recipes_root, recipe_files
from gymv.findings import Finding
from gymv.yamlfile import display_path
from gymv.recipes.suites import SUITES_DIR, driver_for_recipe, entries_missing_reason, load_suites


def suite_accounting(root: str | os.PathLike | None = None) -> list[Finding]:
    """Missing or duplicate suite entries, entries naming no recipe, unexplained disabled entries, and
    recipes without a driver (or drivers without a recipe)."""
    r = Path(root or default_recipes_root()).resolve()
    suites = load_suites(r)
    seen: dict[str, list] = {}
    out = []
    for suite in suites.values():
        for e in suite.entries:
            seen.setdefault(e.recipe, []).append(e)
            if not (r / e.recipe).is_file():
                out.append(Finding("suite.missing-recipe", f"suite entry {e.recipe!r} is not a recipe file", None,
                                   e.where, "fix the path (relative to recipes/) or remove the line"))
        for e in entries_missing_reason(suite):
            out.append(Finding("suite.disabled-reason", f"disabled entry {e.recipe!r} gives no reason", None,
                               e.where, "add `# <why it is disabled>` on the same line"))
    for rec in recipe_files(r):
        rel = rec.relative_to(r).as_posix()
        entries = seen.get(rel, [])
        if not entries:
            out.append(Finding("suite.unlisted", f"recipe {rel} is in no suite", None, display_path(rec),
                               f"add it to one of: {', '.join(suites)}" if suites else
                               f"list it in a suite file, e.g. {SUITES_DIR}/nightly.txt"))
        elif len(entries) > 1:
            out.append(Finding("suite.duplicate", f"recipe {rel} is listed {len(entries)} times: "
                               + ", ".join(e.where for e in entries), None, entries[1].where, "keep exactly one entry"))
        driver = driver_for_recipe(r, rel)
        if not driver.is_file():
            out.append(Finding("driver.missing", f"recipe {rel} has no driver {display_path(driver)}", None,
                               display_path(rec), "add the driver script"))
    for drv in sorted((r / "drivers").rglob("*.sh")):
        rel = drv.relative_to(r / "drivers").with_suffix(".yaml")
        if not (r / rel).is_file():
            out.append(Finding("driver.orphan", f"driver {display_path(drv)} has no recipe {rel.as_posix()}", None,
                               display_path(drv), "remove it or add the recipe"))
    return out
