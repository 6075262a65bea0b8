"""A logger and a tool-call format installed the way a third-party plugin is (a dist-info with entry points), so
tests find them through the registries' entry-point groups."""

from __future__ import annotations

import json

from gymv.envs.protocol import ModelTurn, ToolCall
from gymv.loggers.base import MetricsLogger, numeric
from gymv.rollout.tool_formats import ToolCallFormat


class ListingLogger(MetricsLogger):
    """Keeps the scalars of every row it is given (in this process), for a test to read back."""

    name = "listing"
    rows: list = []

    def log(self, step, metrics):
        type(self).rows.append((step, numeric(metrics)))


class AngleFormat(ToolCallFormat):
    """`<<name {"json": "arguments"}>>`, one call per turn."""

    name = "angle"

    def parse(self, text, call_id_prefix="call"):
        head, sep, rest = text.partition("<<")
        if not sep:
            return ModelTurn(text=text.strip())
        name, _, args = rest.removesuffix(">>").partition(" ")
        return ModelTurn(text=head.strip(), tool_calls=[ToolCall(name, args or "{}", f"{call_id_prefix}_0")])

    def write_calls(self, calls):
        return "".join(f"<<{n} {json.dumps(a)}>>" for n, a in calls)
