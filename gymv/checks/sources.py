"""Where checks come from: a recipe's `checks:` list and a driver's CHECKS comment block.

A driver carries the checks of its full run (all MAX_STEPS) in bash comments, so bash never runs them:

    # ===== BEGIN CHECKS =====
    # median(train/token_mult_prob_error) < 1.1
    # mean(train/reward_mean, last=5) > 0.3
    # ===== END CHECKS =====

A recipe's `checks:` are what `gymv smoke` asserts after its few steps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gymv.errors import GymvError
from gymv.recipes.blocks import begin_marker, end_marker, find_marked_block
from gymv.yamlfile import display_path

BEGIN_CHECKS = begin_marker("CHECKS")
END_CHECKS = end_marker("CHECKS")


@dataclass(frozen=True)
class CheckSource:
    """One check's text, where it was written (`file:line`), and the column its text starts at (1-based)."""

    text: str
    where: str
    column: int = 1


def recipe_checks(rec) -> list[CheckSource]:
    """The `checks:` of a loaded recipe (gymv.config.LoadedRecipe), each at the line that wrote it."""
    checks = rec.raw.get("checks") or []
    if not isinstance(checks, list):
        return []
    out = []
    for i, text in enumerate(checks):
        origin = rec.origin(("checks", i)) or rec.origin("checks")
        out.append(CheckSource(text if isinstance(text, str) else str(text), str(origin) if origin else rec.where))
    return out


def driver_checks(path: str | os.PathLike) -> list[CheckSource]:
    """The checks in a driver's CHECKS block ([] without one); a malformed block is a GymvError at its line."""
    path = Path(path)
    shown = display_path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise GymvError(f"cannot read driver: {e}", where=shown,
                        fix="check that the driver file exists and is readable") from None
    block = find_marked_block(lines, "CHECKS", shown)
    if block is None:
        return []
    begin, end = block
    out: list[CheckSource] = []
    for n in range(begin + 1, end):
        raw = lines[n - 1]
        s = raw.strip()
        if not s:
            continue
        if not s.startswith("#"):
            raise GymvError("a line inside the CHECKS block is not a comment (bash would run it)", where=f"{shown}:{n}",
                            fix="start each check with `# `")
        body = s[1:].strip()
        if body:
            out.append(CheckSource(body, f"{shown}:{n}", raw.index(body) + 1))
    return out
