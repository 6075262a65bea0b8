"""Which teacher scores a sample: each sample goes to exactly one teacher, chosen by its agent name.

The agent name is the row's `agent_ref.name` (the NeMo Gym agent that serves the row), or, for a row
without one, the agent of the environment that ran it. `mopd.agent_to_teacher` maps agent names to teacher
aliases. With `strict_agent_name_match` an agent missing from the map is an error naming it; without it such
an agent goes to `default_teacher_alias`. Routing never guesses: a row that reaches no teacher stops the run
before any compute is spent on it (`check_rows` routes the whole dataset up front).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gymv.envs.rows import agent_name
from gymv.errors import GymvError


@dataclass(frozen=True)
class TeacherRouter:
    teachers: tuple[str, ...]
    agent_to_teacher: Mapping[str, str] = field(default_factory=dict)
    strict: bool = True
    default_alias: str | None = None

    def __post_init__(self) -> None:
        if not self.teachers:
            raise GymvError("MOPD needs at least one teacher", where="mopd.teachers", fix="add a teacher under mopd.teachers")
        known = ", ".join(self.teachers)
        for agent, alias in self.agent_to_teacher.items():
            if alias not in self.teachers:
                raise GymvError(f"agent {agent!r} routes to teacher {alias!r}, which is not in mopd.teachers",
                                where=f"mopd.agent_to_teacher.{agent}", fix=f"use one of: {known}")
        if self.default_alias is not None and self.default_alias not in self.teachers:
            raise GymvError(f"mopd.default_teacher_alias {self.default_alias!r} is not in mopd.teachers",
                            where="mopd.default_teacher_alias", fix=f"use one of: {known}")
        if not self.strict and self.default_alias is None:
            raise GymvError("mopd.strict_agent_name_match is false but no default_teacher_alias catches unmatched agents",
                            where="mopd.strict_agent_name_match",
                            fix="set mopd.default_teacher_alias, or strict_agent_name_match: true")

    @classmethod
    def from_config(cls, mopd) -> TeacherRouter:
        """From a validated `mopd:` section."""
        return cls(tuple(mopd.teachers), dict(mopd.agent_to_teacher), mopd.strict_agent_name_match,
                   mopd.default_teacher_alias)

    def alias_for(self, agent: str | None, *, where: str | None = None) -> str:
        """The one teacher of a sample whose agent is `agent`."""
        if agent is not None and agent in self.agent_to_teacher:
            return self.agent_to_teacher[agent]
        if not self.strict:
            return self.default_alias  # type: ignore[return-value]  (checked in __post_init__)
        mapped = ", ".join(self.agent_to_teacher) or "none"
        name = repr(agent) if agent is not None else "(none: the row has no agent_ref.name)"
        raise GymvError(
            f"no teacher for agent {name}: it is not in mopd.agent_to_teacher (mapped agents: {mapped}) and "
            f"strict_agent_name_match is on", where=where,
            fix=f"add `{agent or '<agent>'}: <teacher alias>` to mopd.agent_to_teacher, or set "
                f"strict_agent_name_match: false with a default_teacher_alias")

    def route(self, agents: Sequence[str | None], wheres: Sequence[str | None] | None = None) -> dict[str, list[int]]:
        """Sample indices per teacher alias (in sample order); aliases without samples are left out."""
        out: dict[str, list[int]] = {}
        for i, agent in enumerate(agents):
            alias = self.alias_for(agent, where=wheres[i] if wheres is not None else None)
            out.setdefault(alias, []).append(i)
        return out

    def check_rows(self, rows: Iterable, default_agent: str | None = None) -> dict[str, int]:
        """Route every data row (objects with `.data` and `.where`) once; rows per alias. Raises on the first
        row that reaches no teacher."""
        counts: dict[str, int] = {}
        for r in rows:
            alias = self.alias_for(row_agent(r.data) or default_agent, where=r.where)
            counts[alias] = counts.get(alias, 0) + 1
        return counts


def row_agent(row: dict) -> str | None:
    return agent_name(row)
