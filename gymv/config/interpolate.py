"""`${...}` interpolation, resolved once on the fully merged tree (so a child's value feeds a parent's reference).

`${a.b}` alone as a value keeps the referenced value's type; inside a longer string it is substituted as
text. `${.b}` and `${..b}` are relative, as in OmegaConf: `b` in the mapping that holds the value, and in the
one above it. `${name:arg,...}` calls a resolver; arguments may themselves be `${...}`. `\\${` writes a literal `${`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymv.config.tree import ConfigTree, dotted, split_key, suggest
from gymv.yamlfile import KeyPath
from gymv.errors import GymvError


@dataclass(frozen=True)
class Ref:
    key: str


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple  # tuple of tuples of parts


Part = str | Ref | Call

_CALL = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*:(.*)$", re.S)
_REF = re.compile(r"^\.*[\w-]+(?:\.[\w-]+)*$")  # leading dots: OmegaConf's relative form, ${.sibling}, ${..uncle}


class InterpolationSyntaxError(ValueError):
    pass


def has_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def parse(text: str) -> tuple[Part, ...]:
    """Split text into literal strings and `${...}` expressions."""
    parts, _ = _parse_seq(text, 0, stop_at=None)
    return parts


def _parse_seq(text: str, i: int, stop_at: str | None) -> tuple[tuple[Part, ...], int]:
    parts: list[Part] = []
    buf: list[str] = []
    while i < len(text):
        if text.startswith("\\${", i):
            buf.append("${")
            i += 3
        elif text.startswith("${", i):
            if buf:
                parts.append("".join(buf))
                buf = []
            expr, i = _parse_expr(text, i + 2)
            parts.append(expr)
        elif stop_at and text[i] in stop_at:
            break
        else:
            buf.append(text[i])
            i += 1
    if buf:
        parts.append("".join(buf))
    return tuple(parts), i


def _parse_expr(text: str, i: int) -> tuple[Part, int]:
    """Parse after `${` up to the matching `}`."""
    depth, j = 1, i
    while j < len(text):
        if text.startswith("${", j):
            depth += 1
            j += 2
            continue
        if text[j] == "}":
            depth -= 1
            if depth == 0:
                break
        j += 1
    else:
        raise InterpolationSyntaxError(f"unterminated '${{' in {text!r}")
    body = text[i:j]
    m = _CALL.match(body)
    if m:
        name, rest = m.group(1), m.group(2)
        args: list[tuple[Part, ...]] = []
        if rest.strip():
            k = 0
            while True:
                arg, k = _parse_seq(rest, k, stop_at=",")
                args.append(_strip_arg(arg))
                if k >= len(rest):
                    break
                k += 1  # skip the comma
        return Call(name, tuple(args)), j + 1
    key = body.strip()
    if not _REF.match(key):
        raise InterpolationSyntaxError(f"'${{{body}}}' is neither a key reference like ${{a.b}} nor a resolver call like ${{add:1,2}}")
    return Ref(key), j + 1


def _strip_arg(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    out = list(parts)
    if out and isinstance(out[0], str):
        out[0] = out[0].lstrip()
    if out and isinstance(out[-1], str):
        out[-1] = out[-1].rstrip()
    return tuple(p for p in out if p != "")


# ---- resolvers -------------------------------------------------------------------------------------------


def _number(v: Any, name: str) -> int | float:
    if isinstance(v, bool) or v is None:
        raise ValueError(f"{name}: {v!r} is not a number")
    if isinstance(v, int | float):
        return v
    if isinstance(v, str):
        for conv in (int, float):
            try:
                return conv(v.strip())
            except ValueError:
                pass
    raise ValueError(f"{name}: {v!r} is not a number")


def _numbers(args: list, name: str, at_least: int = 1) -> list:
    if len(args) < at_least:
        raise ValueError(f"{name} needs at least {at_least} argument{'s' if at_least > 1 else ''}")
    return [_number(a, name) for a in args]


def _add(args: list) -> Any:
    return sum(_numbers(args, "add"))


def _mul(args: list) -> Any:
    return math.prod(_numbers(args, "mul"))


def _max(args: list) -> Any:
    return max(_numbers(args, "max"))


def _div(args: list) -> Any:
    if len(args) != 2:
        raise ValueError("div takes exactly two arguments: ${div:a,b}")
    a, b = _numbers(args, "div")
    if b == 0:
        raise ValueError("div: division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _env(args: list) -> Any:
    if len(args) not in (1, 2) or not isinstance(args[0], str) or not args[0]:
        raise ValueError("oc.env takes a variable name and an optional default: ${oc.env:NAME,default}")
    if args[0] in os.environ:
        return os.environ[args[0]]
    if len(args) == 1:
        raise ValueError(f"environment variable {args[0]} is not set and no default is given")
    default = args[1]
    return None if default == "null" else default


RESOLVERS: dict[str, Callable[[list], Any]] = {
    "add": _add, "mul": _mul, "div": _div, "max": _max, "oc.env": _env,
}


# ---- resolution ------------------------------------------------------------------------------------------


def _as_text(v: Any, expr: str) -> str:
    if isinstance(v, dict | list):
        raise ValueError(f"{expr} is a {'mapping' if isinstance(v, dict) else 'list'} and cannot be embedded in text")
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


class _Resolution:
    def __init__(self, tree: ConfigTree):
        self.tree = tree
        self.memo: dict[KeyPath, Any] = {}
        self.active: list[KeyPath] = []  # string values being evaluated
        self.trail: list[KeyPath] = []  # the same plus the references followed, to show a cycle

    def fail(self, path: KeyPath, message: str, fix: str) -> GymvError:
        origin = self.tree.nearest_origin(path)
        return GymvError(message, where=str(origin) if origin else None, fix=fix)

    def node(self, path: KeyPath, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.node(path + (k,), v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.node(path + (i,), v) for i, v in enumerate(value)]
        if has_interpolation(value):
            return self.string(path, value)
        if isinstance(value, str) and "\\${" in value:
            return value.replace("\\${", "${")
        return value

    def string(self, path: KeyPath, text: str) -> Any:
        if path in self.memo:
            return self.memo[path]
        if path in self.active:
            loop = self.trail[self.trail.index(path):] + [path]
            names = [dotted(p) for i, p in enumerate(loop) if i == 0 or p != loop[i - 1]]
            raise self.fail(path, f"interpolation cycle: {' -> '.join(names)}", "make one of these keys a plain value")
        self.active.append(path)
        self.trail.append(path)
        try:
            try:
                parts = parse(text)
            except InterpolationSyntaxError as e:
                raise self.fail(path, f"bad interpolation in `{dotted(path)}`: {e}",
                                "write ${section.key} or ${add:a,b}; escape a literal with \\${") from None
            value = self.parts(path, parts)
        finally:
            self.active.pop()
            self.trail.pop()
        self.memo[path] = value
        return value

    def parts(self, path: KeyPath, parts: tuple[Part, ...]) -> Any:
        if len(parts) == 1 and not isinstance(parts[0], str):
            return self.expr(path, parts[0])
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append(p)
            else:
                v = self.expr(path, p)
                try:
                    out.append(_as_text(v, _show(p)))
                except ValueError as e:
                    raise self.fail(path, f"`{dotted(path)}`: {e}", f"reference a scalar, or make {_show(p)} the whole value") from None
        return "".join(out)

    def target(self, path: KeyPath, key: str) -> KeyPath | None:
        """The key path `key` names from the value at `path`: absolute, or relative as OmegaConf reads it (one
        leading dot is the node holding the value, each further dot one node up)."""
        dots = len(key) - len(key.lstrip("."))
        if not dots:
            return split_key(self.tree.data, key)
        if dots > len(path):
            raise self.fail(path, f"`{dotted(path)}` references ${{{key}}}, which climbs above the top of the config",
                            "use fewer leading dots, or the key's full dotted path")
        base = path[:len(path) - dots]
        rest = split_key(self.tree.get(base) if base else self.tree.data, key[dots:])
        return None if rest is None else base + rest

    def expr(self, path: KeyPath, e: Part) -> Any:
        if isinstance(e, Ref):
            target = self.target(path, e.key)
            if target is None:
                near = suggest(e.key, self.tree.keys())
                fix = f"did you mean ${{{near}}}?" if near else "reference an existing key with its full dotted path"
                raise self.fail(path, f"`{dotted(path)}` references ${{{e.key}}}, which does not exist", fix)
            if path and target[: len(path)] == path:
                raise self.fail(path, f"interpolation cycle: `{dotted(path)}` refers to ${{{e.key}}}, which is itself or inside it",
                                "make one of these keys a plain value")
            self.trail.append(target)
            try:
                return self.node(target, self.tree.get(target))
            finally:
                self.trail.pop()
        assert isinstance(e, Call)
        fn = RESOLVERS.get(e.name)
        if fn is None:
            near = suggest(e.name, list(RESOLVERS))
            raise self.fail(path, f"`{dotted(path)}` calls unknown resolver `{e.name}`",
                            f"did you mean `{near}`?" if near else f"use one of: {', '.join(RESOLVERS)}")
        args = [self.parts(path, a) if a else "" for a in e.args]
        try:
            return fn(args)
        except ValueError as err:
            raise self.fail(path, f"`{dotted(path)}`: {_show(e)} failed: {err}{self._blame(e, args)}",
                            "fix the resolver's arguments") from None

    def _blame(self, e: Call, args: list) -> str:
        """Where a non-numeric argument came from, when it is a reference (often an override)."""
        for parts, value in zip(e.args, args):
            if len(parts) == 1 and isinstance(parts[0], Ref):
                try:
                    _number(value, e.name)
                except ValueError:
                    origin = self.tree.origin(parts[0].key)
                    return f" (the value of ${{{parts[0].key}}}" + (f", written at {origin})" if origin else ")")
        return ""


def _show(e: Part) -> str:
    if isinstance(e, Ref):
        return f"${{{e.key}}}"
    if isinstance(e, Call):
        return f"${{{e.name}:...}}"
    return e


def resolve(tree: ConfigTree) -> dict:
    """The tree's data with every `${...}` replaced; raises GymvError at the key's file:line on failure."""
    return _Resolution(tree).node((), tree.data)


def interpolation_errors(tree: ConfigTree) -> list[GymvError]:
    """Every value whose `${...}` fails, one error each (`resolve` stops at the first), for `gymv lint`."""
    res, errors, seen = _Resolution(tree), [], set()
    for path, value in tree.leaves():
        if not has_interpolation(value):
            continue
        try:
            res.string(path, value)
        except GymvError as e:
            res.active.clear()
            res.trail.clear()
            if str(e) not in seen:
                seen.add(str(e))
                errors.append(e)
    return errors
