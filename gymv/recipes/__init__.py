"""Test-suite accounting for recipes: driver CONFIG blocks, suite lists, budgets and GPU-hours.

Nothing here executes a shell. Driver blocks are read by a small parser of the assignment subset of bash
(`gymv.recipes.shell`, `gymv.recipes.arith`), so that `gymv dry-run` and `gymv lint` see exactly what a
driver would set, without running it and without one script's variables leaking into the next.
"""

from gymv.recipes.drivers import DriverConfig, parse_driver
from gymv.recipes.gpu_hours import ROUNDING_RULE, DryRun, format_gpu_hours, plan
from gymv.recipes.suites import (
    Suite,
    SuiteEntry,
    driver_for_recipe,
    load_budgets,
    load_suites,
    recipe_for_driver,
)

__all__ = [
    "DriverConfig",
    "DryRun",
    "ROUNDING_RULE",
    "Suite",
    "SuiteEntry",
    "driver_for_recipe",
    "format_gpu_hours",
    "load_budgets",
    "load_suites",
    "parse_driver",
    "plan",
    "recipe_for_driver",
]
