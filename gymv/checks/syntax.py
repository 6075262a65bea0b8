"""The language of metric checks: a tokenizer and a recursive-descent parser to a small typed AST.

    median(train/token_mult_prob_error) < 1.1
    mean(train/reward_mean, last=3) > 0.2 and max(train/grad_norm, steps=2:) < 50
    0.9 < ratio_above(val/accuracy, 0.5, first=4) / 2 + 0.1

Only numbers, metric names (inside a statistic), statistic calls, arithmetic (+ - * /), comparisons
(chained as in Python), and/or/not and parentheses exist. There are no strings, attributes, indexing,
exponents or names other than metrics and the statistics, so nothing a check says can reach Python
objects: it is data to a tree-walking evaluator, never code. Length, nesting and literal sizes are bounded.
Every error names the 1-based column and carries the text for a caret display.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gymv.errors import GymvError

MAX_LENGTH = 1000  # characters in one check
MAX_DEPTH = 32  # nested parentheses, calls, unary signs and `not`s
MAX_LITERAL = 1e15  # largest number a check may write
MAX_STEP = 10**9  # largest step number or count in first=/last=/steps=

STATISTICS: dict[str, tuple[str, ...]] = {  # name -> positional parameters after the metric
    "mean": (),
    "median": (),
    "min": (),
    "max": (),
    "ratio_above": ("threshold",),
}
SELECTORS = ("first", "last", "steps")
KEYWORDS = ("and", "or", "not")
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")

_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:[./][A-Za-z0-9_]+)*")
_QUOTED = re.compile(r"`([A-Za-z0-9_./\-]+)`")
_TWO_CHAR = ("<=", ">=", "==", "!=")
_ONE_CHAR = "<>(),=:+-*/"
_REFUSED = {
    "**": "the exponent operator `**` is not allowed",
    "//": "floor division `//` is not allowed (use /)",
    "^": "`^` is not an operator in checks (there is no exponent)",
    "'": "strings are not allowed (write metric names bare, or in `backticks`)",
    '"': "strings are not allowed (write metric names bare, or in `backticks`)",
    "[": "indexing is not allowed",
    "]": "indexing is not allowed",
    "{": "`{` is not allowed",
    "}": "`}` is not allowed",
    ".": "attribute access is not allowed",
    "%": "`%` is not allowed",
    "&": "use `and`",
    "|": "use `or`",
    "!": "use `not` (or != for inequality)",
    "~": "use `not`",
    ";": "a check is one expression (list several checks as separate entries)",
    "@": "`@` is not allowed",
    "\\": "`\\` is not allowed",
    "#": "comments are not allowed inside a check",
    "$": "`$` is not allowed",
}
_FIX = "write e.g. median(train/token_mult_prob_error) < 1.1 (grammar: docs/smoke-and-report.md)"


class CheckError(GymvError):
    """A problem with a check, at a 0-based character offset `pos` of its text."""

    kind = "check"

    def __init__(self, message: str, text: str, pos: int, *, fix: str | None = None, where: str | None = None):
        self.text, self.pos, self.reason = text, pos, message
        super().__init__(f"{message} at column {pos + 1}", where=where, fix=fix)

    def caret(self) -> str:
        """The check and a caret under the offending character (two lines)."""
        shown = self.text.replace("\n", " ").replace("\t", " ")
        return f"{shown}\n{' ' * min(self.pos, len(shown))}^"


class CheckSyntaxError(CheckError):
    kind = "syntax"


# ---- AST ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    pos: int
    end: int

    def span(self, text: str) -> str:
        return text[self.pos:self.end]


@dataclass(frozen=True)
class Num(Node):
    value: float


@dataclass(frozen=True)
class Metric(Node):
    name: str


@dataclass(frozen=True)
class Call(Node):
    func: str
    metric: Metric
    args: tuple[Node, ...] = ()
    first: int | None = None
    last: int | None = None
    steps: tuple[int | None, int | None] | None = None  # inclusive; None = open end


@dataclass(frozen=True)
class Unary(Node):
    op: str
    operand: Node


@dataclass(frozen=True)
class BinOp(Node):
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Compare(Node):
    operands: tuple[Node, ...]
    ops: tuple[str, ...]


@dataclass(frozen=True)
class BoolOp(Node):
    op: str  # and | or
    values: tuple[Node, ...]


@dataclass(frozen=True)
class Not(Node):
    operand: Node


@dataclass(frozen=True)
class Check:
    """A parsed check: its text, its tree and the metric names it reads (with their positions)."""

    text: str
    tree: Node
    metrics: tuple[Metric, ...] = field(default=())

    def calls(self) -> list[Call]:
        out: list[Call] = []
        _walk(self.tree, lambda n: out.append(n) if isinstance(n, Call) else None)
        return out


def _walk(node: Node, visit) -> None:
    visit(node)
    children: tuple = ()
    if isinstance(node, Call):
        children = (node.metric, *node.args)
    elif isinstance(node, (Unary, Not)):
        children = (node.operand,)
    elif isinstance(node, BinOp):
        children = (node.left, node.right)
    elif isinstance(node, Compare):
        children = node.operands
    elif isinstance(node, BoolOp):
        children = node.values
    for c in children:
        _walk(c, visit)


# ---- tokens ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Token:
    kind: str  # num | name | kw | op | end
    text: str
    pos: int
    end: int
    value: float | str | None = None


def tokenize(text: str) -> list[Token]:
    if not isinstance(text, str):
        raise CheckSyntaxError(f"a check must be text, got {type(text).__name__}", str(text), 0, fix=_FIX)
    if len(text) > MAX_LENGTH:
        raise CheckSyntaxError(f"check is {len(text)} characters long, the limit is {MAX_LENGTH}", text, MAX_LENGTH,
                               fix="split it into several checks")
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            m = _NUMBER.match(text, i)
            lit = m.group()
            after = m.end()
            if after < n and (text[after].isalpha() or text[after] == "_"):
                raise CheckSyntaxError(f"unexpected `{text[after]}` after the number {lit}", text, after, fix=_FIX)
            if len(lit) > 40:
                raise CheckSyntaxError("number literal is too long", text, i, fix=f"use numbers up to {MAX_LITERAL:g}")
            value = float(lit)
            if not math.isfinite(value) or abs(value) > MAX_LITERAL:
                raise CheckSyntaxError(f"number {lit} is out of range (at most {MAX_LITERAL:g})", text, i,
                                       fix=f"use numbers up to {MAX_LITERAL:g}")
            out.append(Token("num", lit, i, after, value))
            i = after
            continue
        if c.isalpha() or c == "_":
            m = _NAME.match(text, i)
            name = m.group()
            if "__" in name:
                raise CheckSyntaxError(f"`{name}` is not a metric or statistic name (`__` is not allowed)", text, i, fix=_FIX)
            kind = "kw" if name in KEYWORDS else "name"
            out.append(Token(kind, name, i, m.end(), name))
            i = m.end()
            continue
        if c == "`":
            m = _QUOTED.match(text, i)
            if not m:
                raise CheckSyntaxError("a `quoted` metric name needs a closing backtick and may hold only letters, "
                                       "digits and _ . / -", text, i, fix=_FIX)
            if "__" in m.group(1):
                raise CheckSyntaxError(f"`{m.group(1)}` is not a metric name (`__` is not allowed)", text, i, fix=_FIX)
            out.append(Token("name", m.group(), i, m.end(), m.group(1)))
            i = m.end()
            continue
        two = text[i:i + 2]
        if two in _REFUSED:
            raise CheckSyntaxError(_REFUSED[two], text, i, fix=_FIX)
        if two in _TWO_CHAR:
            out.append(Token("op", two, i, i + 2))
            i += 2
            continue
        if c in _REFUSED:
            raise CheckSyntaxError(_REFUSED[c], text, i, fix=_FIX)
        if c in _ONE_CHAR:
            out.append(Token("op", c, i, i + 1))
            i += 1
            continue
        raise CheckSyntaxError(f"unexpected character {c!r}", text, i, fix=_FIX)
    out.append(Token("end", "", n, n))
    return out


# ---- parser ------------------------------------------------------------------------------------------------

class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = tokenize(text)
        self.i = 0
        self.depth = 0

    # helpers
    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def peek(self, k: int = 1) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self) -> Token:
        t = self.toks[self.i]
        self.i += 1
        return t

    def is_op(self, *ops: str) -> bool:
        return self.tok.kind == "op" and self.tok.text in ops

    def is_kw(self, kw: str) -> bool:
        return self.tok.kind == "kw" and self.tok.text == kw

    def error(self, message: str, pos: int | None = None, fix: str | None = _FIX) -> CheckSyntaxError:
        return CheckSyntaxError(message, self.text, self.tok.pos if pos is None else pos, fix=fix)

    def unexpected(self, wanted: str) -> CheckSyntaxError:
        t = self.tok
        if t.kind == "end":
            return self.error(f"the check ends where {wanted} was expected")
        return self.error(f"unexpected `{t.text}` where {wanted} was expected")

    def expect_op(self, op: str, wanted: str) -> Token:
        if not self.is_op(op):
            raise self.unexpected(wanted)
        return self.take()

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"the check nests more than {MAX_DEPTH} levels deep", pos, fix="simplify the check")

    def leave(self) -> None:
        self.depth -= 1

    # grammar (lowest precedence first)
    def parse(self) -> Check:
        if self.tok.kind == "end":
            raise self.error("the check is empty")
        tree = self.expr()
        if self.tok.kind != "end":
            raise self.unexpected("an operator or the end of the check")
        _require(tree, "bool", self.text, "a check must be a condition (a comparison such as `mean(train/loss) < 2`)")
        metrics: list[Metric] = []
        _walk(tree, lambda n: metrics.append(n) if isinstance(n, Metric) else None)
        return Check(self.text, tree, tuple(metrics))

    def expr(self) -> Node:
        return self.boolop("or", self.and_)

    def and_(self) -> Node:
        return self.boolop("and", self.not_)

    def boolop(self, kw: str, sub) -> Node:
        first = sub()
        values = [first]
        while self.is_kw(kw):
            self.take()
            values.append(sub())
        if len(values) == 1:
            return first
        for v in values:
            _require(v, "bool", self.text, f"`{kw}` joins conditions (comparisons), not numbers")
        return BoolOp(first.pos, values[-1].end, kw, tuple(values))

    def not_(self) -> Node:
        if self.is_kw("not"):
            t = self.take()
            self.enter(t.pos)
            operand = self.not_()
            self.leave()
            _require(operand, "bool", self.text, "`not` applies to a condition (a comparison)")
            return Not(t.pos, operand.end, operand)
        return self.compare()

    def compare(self) -> Node:
        first = self.sum()
        operands, ops = [first], []
        while self.tok.kind == "op" and self.tok.text in COMPARISONS:
            ops.append(self.take().text)
            operands.append(self.sum())
        if not ops:
            return first
        for o in operands:
            _require(o, "num", self.text, "comparisons compare numbers")
        return Compare(first.pos, operands[-1].end, tuple(operands), tuple(ops))

    def sum(self) -> Node:
        left = self.term()
        while self.is_op("+", "-"):
            op = self.take().text
            right = self.term()
            left = self.arith(op, left, right)
        return left

    def term(self) -> Node:
        left = self.unary()
        while self.is_op("*", "/"):
            op = self.take().text
            right = self.unary()
            left = self.arith(op, left, right)
        return left

    def arith(self, op: str, left: Node, right: Node) -> Node:
        _require(left, "num", self.text, f"`{op}` works on numbers")
        _require(right, "num", self.text, f"`{op}` works on numbers")
        return BinOp(left.pos, right.end, op, left, right)

    def unary(self) -> Node:
        if self.is_op("-", "+"):
            t = self.take()
            self.enter(t.pos)
            operand = self.unary()
            self.leave()
            _require(operand, "num", self.text, f"`{t.text}` works on numbers")
            return Unary(t.pos, operand.end, t.text, operand)
        return self.atom()

    def atom(self) -> Node:
        t = self.tok
        if t.kind == "num":
            self.take()
            return Num(t.pos, t.end, float(t.value))
        if t.kind == "name":
            if self.peek().kind == "op" and self.peek().text == "(" and not t.text.startswith("`"):
                return self.call()
            self.take()
            return Metric(t.pos, t.end, str(t.value))
        if self.is_op("("):
            self.take()
            self.enter(t.pos)
            inner = self.expr()
            self.leave()
            close = self.expect_op(")", "`)`")
            return _reposition(inner, t.pos, close.end)
        if t.kind == "kw":
            raise self.error(f"`{t.text}` needs a condition on its left" if t.text != "not" else "unexpected `not`")
        raise self.unexpected("a number, a statistic such as mean(...) or `(`")

    def call(self) -> Call:
        name_tok = self.take()
        func = name_tok.text
        if func not in STATISTICS:
            raise self.error(f"unknown function `{func}`", name_tok.pos,
                             fix=f"use one of {', '.join(STATISTICS)}")
        self.enter(name_tok.pos)
        self.take()  # (
        params = STATISTICS[func]
        usage = f"{func}(METRIC{''.join(', ' + p.upper() for p in params)}[, first=N | last=N][, steps=A:B])"
        if self.tok.kind != "name" or (self.peek().kind == "op" and self.peek().text in ("(", "=")):
            raise self.error(f"`{func}` takes a metric name first, e.g. {func}(train/loss"
                             f"{', 0.5' if params else ''})", fix=f"write {usage}")
        mt = self.take()
        metric = Metric(mt.pos, mt.end, str(mt.value))
        args: list[Node] = []
        kwargs: dict[str, tuple[Token, object]] = {}
        while self.is_op(","):
            self.take()
            if self.tok.kind == "name" and self.peek().kind == "op" and self.peek().text == "=":
                key_tok = self.take()
                self.take()  # =
                if key_tok.text not in SELECTORS:
                    raise self.error(f"unknown keyword `{key_tok.text}`", key_tok.pos,
                                     fix=f"use first=N, last=N or steps=A:B ({usage})")
                if key_tok.text in kwargs:
                    raise self.error(f"`{key_tok.text}` is given twice", key_tok.pos, fix=f"write {usage}")
                value = self.steps_range() if key_tok.text == "steps" else self.count(key_tok.text)
                kwargs[key_tok.text] = (key_tok, value)
                continue
            if kwargs:
                raise self.error("a positional argument follows a keyword argument", fix=f"write {usage}")
            arg = self.expr()
            _require(arg, "num", self.text, f"the {params[len(args)] if len(args) < len(params) else 'extra'} "
                     f"argument of `{func}` must be a number")
            args.append(arg)
        close = self.expect_op(")", "`,` or `)`")
        self.leave()
        if len(args) != len(params):
            raise self.error(f"`{func}` takes {1 + len(params)} argument{'s' if params else ''} "
                             f"(the metric{''.join(', ' + p for p in params)}), got {1 + len(args)}",
                             name_tok.pos, fix=f"write {usage}")
        if "first" in kwargs and "last" in kwargs:
            raise self.error("use either first= or last=, not both", kwargs["last"][0].pos, fix=f"write {usage}")
        get = lambda k: kwargs[k][1] if k in kwargs else None  # noqa: E731
        return Call(name_tok.pos, close.end, func, metric, tuple(args), get("first"), get("last"), get("steps"))

    def integer(self, what: str) -> int:
        t = self.tok
        if t.kind != "num" or not t.text.isdigit():
            raise self.unexpected(f"a whole number ({what})")
        self.take()
        v = int(t.text)
        if v > MAX_STEP:
            raise self.error(f"{v} is too large for {what} (at most {MAX_STEP})", t.pos)
        return v

    def count(self, key: str) -> int:
        t = self.tok
        v = self.integer(f"{key}=N")
        if v < 1:
            raise self.error(f"{key}= needs at least 1", t.pos)
        return v

    def steps_range(self) -> tuple[int | None, int | None]:
        """`A:B` (inclusive), `A:`, `:B` or `A` (that one step)."""
        start_tok = self.tok
        lo = hi = None
        if self.tok.kind == "num":
            lo = self.integer("a step number")
        if self.is_op(":"):
            self.take()
            if self.tok.kind == "num":
                hi = self.integer("a step number")
        elif lo is not None:
            hi = lo
        else:
            raise self.unexpected("a step range A:B")
        if lo is not None and hi is not None and hi < lo:
            raise self.error(f"step range {lo}:{hi} is empty (the end comes before the start)", start_tok.pos)
        return lo, hi


def _type(node: Node) -> str:
    if isinstance(node, (Compare, BoolOp, Not)):
        return "bool"
    if isinstance(node, Metric):
        return "metric"
    return "num"


def _require(node: Node, want: str, text: str, message: str) -> None:
    have = _type(node)
    if have == want:
        return
    if have == "metric":
        raise CheckSyntaxError(f"metric `{node.name}` must be inside a statistic, e.g. mean({node.name})", text,
                               node.pos, fix="use mean, median, min, max or ratio_above (last=1 gives the last value)")
    raise CheckSyntaxError(message, text, node.pos, fix=_FIX)


def _reposition(node: Node, pos: int, end: int) -> Node:
    """A parenthesised node spans its parentheses (for display); everything else about it stays."""
    import dataclasses

    return dataclasses.replace(node, pos=pos, end=end)


def parse_check(text: str, *, where: str | None = None) -> Check:
    """Parse one check; a CheckSyntaxError names the column (and `where`, e.g. `recipe.yaml:12`)."""
    try:
        return _Parser(text).parse()
    except CheckSyntaxError as e:
        if where is not None:
            raise CheckSyntaxError(e.reason, e.text, e.pos, fix=e.fix, where=where) from None
        raise
