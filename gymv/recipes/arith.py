"""Integer arithmetic as bash's `$(( ))` does it, for the subset driver blocks use: + - * / % and parentheses.

A hand-written recursive-descent parser, never `eval`: driver files are input, not code. Division and
remainder truncate toward zero like C and bash (for the non-negative values drivers use this is floor
division). Where bash would quietly read an unset name as 0 or `010` as octal, this refuses instead, so a
typo cannot turn into a wrong GPU-hour figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gymv.errors import GymvError

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\*\*|[-+*/%()])|(\S))")
INTEGER = re.compile(r"[+-]?(?:0|[1-9][0-9]*)")

OPERATORS_HELP = "use integers, earlier variables, + - * / % and parentheses"


def parse_integer(text: str) -> int | None:
    """The integer a variable's value spells, or None; leading zeros are refused (bash reads them as octal)."""
    s = text.strip()
    return int(s) if INTEGER.fullmatch(s) else None


def evaluate(expr: str, lookup: Callable[[str], str | None], *, where: str) -> int:
    """Evaluate `expr`; `lookup(name)` returns a variable's value or None when it is not set."""
    tokens = _tokenize(expr, where)
    parser = _Parser(tokens, lookup, where, expr)
    if not tokens:
        raise GymvError("empty arithmetic expression $(( ))", where=where, fix=OPERATORS_HELP)
    try:
        value = parser.expression()
    except RecursionError:
        raise GymvError("arithmetic $(( )) nests too deeply", where=where, fix="write a flat expression") from None
    except ValueError as e:  # a literal of more than 4300 digits
        raise GymvError(f"arithmetic $(( )) holds a number too long: {str(e).split(';')[0]}", where=where,
                        fix="use a shorter number") from None
    if parser.pos != len(tokens):
        raise parser.malformed(f"unexpected {parser.tokens[parser.pos][1]!r}")
    return value


def _tokenize(expr: str, where: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:  # only trailing whitespace is left
            break
        pos = m.end()
        number, name, op, other = m.groups()
        if number is not None:
            if len(number) > 1 and number.startswith("0"):
                raise GymvError(
                    f"arithmetic literal {number!r} has a leading zero (bash reads it as octal)",
                    where=where, fix=f"write {int(number)}",
                )
            tokens.append(("num", number))
        elif name is not None:
            tokens.append(("name", name))
        elif op is not None:
            if op == "**":
                raise GymvError(f"unsupported operator '**' in $(( {expr.strip()} ))", where=where, fix=OPERATORS_HELP)
            tokens.append(("op", op))
        elif other is not None:
            raise GymvError(f"malformed arithmetic $(( {expr.strip()} )): unexpected {other!r}", where=where, fix=OPERATORS_HELP)
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], lookup: Callable[[str], str | None], where: str, expr: str):
        self.tokens = tokens
        self.lookup = lookup
        self.where = where
        self.expr = expr
        self.pos = 0

    def malformed(self, why: str) -> GymvError:
        return GymvError(f"malformed arithmetic $(( {self.expr.strip()} )): {why}", where=self.where, fix=OPERATORS_HELP)

    def peek(self) -> str | None:
        if self.pos < len(self.tokens) and self.tokens[self.pos][0] == "op":
            return self.tokens[self.pos][1]
        return None

    def expression(self) -> int:
        value = self.term()
        while (op := self.peek()) in ("+", "-"):
            self.pos += 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> int:
        value = self.unary()
        while (op := self.peek()) in ("*", "/", "%"):
            self.pos += 1
            rhs = self.unary()
            if op == "*":
                value *= rhs
            elif rhs == 0:
                raise GymvError(f"division by zero in $(( {self.expr.strip()} ))", where=self.where, fix="check the divisor's value")
            else:
                quotient = abs(value) // abs(rhs) * (1 if (value >= 0) == (rhs >= 0) else -1)
                value = quotient if op == "/" else value - rhs * quotient
        return value

    def unary(self) -> int:
        op = self.peek()
        if op in ("+", "-"):
            self.pos += 1
            value = self.unary()
            return -value if op == "-" else value
        return self.primary()

    def primary(self) -> int:
        if self.pos >= len(self.tokens):
            raise self.malformed("expression ends early")
        kind, text = self.tokens[self.pos]
        self.pos += 1
        if kind == "num":
            return int(text)
        if kind == "name":
            value = self.lookup(text)
            if value is None:
                raise GymvError(
                    f"unknown variable {text!r} in $(( {self.expr.strip()} ))",
                    where=self.where, fix=f"set {text} earlier in the CONFIG block (bash would silently use 0)",
                )
            number = parse_integer(value)
            if number is None:
                raise GymvError(
                    f"variable {text} = {value!r} is not an integer, in $(( {self.expr.strip()} ))",
                    where=self.where, fix=f"give {text} a whole-number value",
                )
            return number
        if text == "(":
            value = self.expression()
            if self.peek() != ")":
                raise self.malformed("missing ')'")
            self.pos += 1
            return value
        raise self.malformed(f"unexpected {text!r}")
