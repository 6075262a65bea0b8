"""Generator knobs: a frozen dataclass per environment, named presets, and `key=value` overrides.

Knob types follow the preset's value: int, float, bool, str, an inclusive integer range written `lo:hi`
(or a single `n`), and a list of names written `a,b,c`. Each field's metadata carries a `help` line, which
`gymv prepare ENV --list-knobs` shows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gymv.errors import GymvError


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "text"
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "range"
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return "names"
    raise TypeError(f"unsupported knob value {value!r}")


def format_knob(value: Any) -> str:
    kind = _kind(value)
    if kind == "range":
        return str(value[0]) if value[0] == value[1] else f"{value[0]}:{value[1]}"
    if kind == "names":
        return ",".join(value)
    if kind == "bool":
        return "true" if value else "false"
    return str(value)


def _parse(name: str, text: str, current: Any) -> Any:
    kind = _kind(current)
    bad = GymvError(f"knob {name}={text!r} is not a valid {kind}",
                    fix={"range": f"write {name}=LO:HI or {name}=N", "bool": f"write {name}=true or {name}=false",
                         "names": f"write {name}=a,b,c"}.get(kind, f"write {name}=<{kind}>"))
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "text":
            return text
        if kind == "bool":
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise bad
        if kind == "range":
            lo, sep, hi = text.partition(":")
            lo_i = int(lo)
            hi_i = int(hi) if sep else lo_i
            if hi_i < lo_i:
                raise GymvError(f"knob {name}={text!r} is an empty range (low > high)", fix=f"write {name}={hi_i}:{lo_i}")
            return (lo_i, hi_i)
        if kind == "names":
            names = tuple(s.strip() for s in text.split(",") if s.strip())
            if not names:
                raise bad
            return names
    except ValueError:
        raise bad from None
    raise bad


def resolve_knobs(env: Any, preset: str = "default", overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The preset's knobs with `key=value` overrides applied and checked by the environment."""
    presets = getattr(env, "presets", {}) or {}
    if preset not in presets:
        raise GymvError(f"{env.name} has no preset {preset!r}", fix=f"use one of: {', '.join(presets) or 'none'}")
    knobs = presets[preset]
    fields = {f.name for f in dataclasses.fields(knobs)}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise GymvError(f"knob {item!r} is not KEY=VALUE", fix="write knobs like circles=1:3")
        if key not in fields:
            raise GymvError(f"{env.name} has no knob {key!r}", fix=f"knobs: {', '.join(sorted(fields)) or 'none'}")
        changes[key] = _parse(key, text, getattr(knobs, key))
    knobs = dataclasses.replace(knobs, **changes)
    env.check_knobs(knobs)
    return knobs


def describe_knobs(knobs: Any) -> list[tuple[str, str, str]]:
    """(name, value, help) for each knob, in declaration order."""
    return [(f.name, format_knob(getattr(knobs, f.name)), f.metadata.get("help", ""))
            for f in dataclasses.fields(knobs)]


def knobs_dict(knobs: Any) -> dict[str, Any]:
    return {f.name: getattr(knobs, f.name) for f in dataclasses.fields(knobs)}


def knob(default: Any, help: str) -> Any:
    """A dataclass field with a help line (immutable defaults only: ints, strings, tuples)."""
    return dataclasses.field(default=default, metadata={"help": help})
