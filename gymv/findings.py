"""Problems found in a recipe, in one shape for both the loader (which raises) and `gymv lint` (which lists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gymv.errors import GymvError

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem: `rule` is a stable id (for docs and suppression), `key` the dotted config key if any."""

    rule: str
    message: str
    key: str | None = None
    where: str | None = None
    fix: str | None = None
    severity: Severity = "error"

    def located(self, where: str | None) -> "Finding":
        return Finding(self.rule, self.message, self.key, where or self.where, self.fix, self.severity)

    def to_error(self) -> GymvError:
        return GymvError(self.message, where=self.where, fix=self.fix)

    def one_line(self) -> str:
        return self.to_error().one_line()


def raise_first_error(findings: list[Finding]) -> None:
    """Raise the first error-severity finding as a GymvError, noting how many more there are."""
    errors = [f for f in findings if f.severity == "error"]
    if not errors:
        return
    err = errors[0].to_error()
    if len(errors) > 1:
        more = len(errors) - 1
        err = GymvError(f"{err.message} (and {more} more error{'s' if more > 1 else ''}; `gymv lint` lists all)",
                        where=err.where, fix=err.fix)
    raise err
