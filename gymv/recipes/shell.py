"""The assignment subset of bash that driver CONFIG blocks are written in, read without running a shell.

Supported, as bash means them: `NAME=value`, `export NAME=value`, `export NAME`, several assignments on one
line or separated by `;`, single and double quotes, backslash escapes, line continuations, `$NAME`,
`${NAME}`, `${NAME:-default}` / `${NAME-default}` / `${NAME:=default}` / `${NAME=default}`, `$(( ))`
integer arithmetic (`gymv.recipes.arith`) and `# comments`. Anything that would run a command (`$(...)`,
backticks, pipes, redirections) or that bash would resolve from the caller's shell (`$0`, `$@`) is an
error naming the file and line: a dry run must not depend on what happens to be in the user's environment.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gymv.errors import GymvError
from gymv.recipes import arith

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ONLY_ASSIGNMENTS = "keep only NAME=value / export NAME=value lines between the CONFIG markers; move commands below the END marker"


@dataclass
class Scope:
    """Variables visible to a block: their values, which are exported, and where each was set."""

    values: dict[str, str] = field(default_factory=dict)
    exported: set[str] = field(default_factory=set)
    origin: dict[str, str] = field(default_factory=dict)

    @classmethod
    def inherited(cls, env: Mapping[str, str], origin: Mapping[str, str] | None = None) -> Scope:
        """A fresh scope for a new script: only `env` (the exported variables of its caller) is visible."""
        origin = origin or {}
        return cls(dict(env), set(env), {k: origin.get(k, "the environment") for k in env})

    def exported_values(self) -> dict[str, str]:
        return {k: self.values[k] for k in self.exported if k in self.values}

    def set(self, name: str, value: str, where: str, *, export: bool = False) -> None:
        self.values[name] = value
        self.origin[name] = where
        if export:
            self.exported.add(name)


def run_block(lines: Iterable[tuple[int, str]], scope: Scope, label: str) -> list[tuple[str, int]]:
    """Apply each assignment of a block to `scope`, in order; returns (name, line) of every assignment."""
    assigned: list[tuple[str, int]] = []
    for lineno, text in _join_continuations(lines, label):
        _Line(text, f"{label}:{lineno}", scope, assigned, lineno).run()
    return assigned


def _join_continuations(lines: Iterable[tuple[int, str]], label: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for lineno, text in lines:
        if pending is not None:
            lineno, text = pending[0], pending[1] + text
            pending = None
        stripped = text.rstrip("\n")
        trailing = len(stripped) - len(stripped.rstrip("\\"))
        if trailing % 2 == 1:  # an odd run of backslashes escapes the newline
            pending = (lineno, stripped[:-1])
            continue
        out.append((lineno, stripped))
    if pending is not None:
        raise GymvError("line continuation '\\' at the end of the CONFIG block", where=f"{label}:{pending[0]}",
                        fix="remove the trailing backslash")
    return out


class _Line:
    """One logical line: a sequence of `[export] NAME=word ...` commands separated by ';'."""

    def __init__(self, text: str, where: str, scope: Scope, assigned: list[tuple[str, int]], lineno: int):
        self.text = text
        self.n = len(text)
        self.pos = 0
        self.where = where
        self.scope = scope
        self.assigned = assigned
        self.lineno = lineno

    def error(self, message: str, fix: str | None = None) -> GymvError:
        return GymvError(message, where=self.where, fix=fix)

    # -- statements ---------------------------------------------------------------------------------

    def skip_blanks(self) -> None:
        while self.pos < self.n and self.text[self.pos] in " \t":
            self.pos += 1

    def at_word_end(self) -> bool:
        return self.pos >= self.n or self.text[self.pos] in " \t;"

    def run(self) -> None:
        command_start = True
        export = False
        while True:
            self.skip_blanks()
            if self.pos >= self.n or self.text[self.pos] == "#":
                return
            if self.text[self.pos] == ";":
                self.pos += 1
                command_start, export = True, False
                continue
            m = _NAME.match(self.text, self.pos)
            if command_start and m and m.group() == "export" and (m.end() >= self.n or self.text[m.end()] in " \t;"):
                self.pos = m.end()
                command_start, export = False, True
                continue
            if m and m.end() < self.n and self.text[m.end()] == "=":
                name = m.group()
                self.pos = m.end() + 1
                value = self.word("top")
                self.scope.set(name, value, self.where, export=export)
                self.assigned.append((name, self.lineno))
                command_start = False
                continue
            if export and m and (m.end() >= self.n or self.text[m.end()] in " \t;"):
                self.scope.exported.add(m.group())
                self.pos = m.end()
                continue
            rest = self.text[self.pos:].strip()
            raise self.error(f"not an assignment: {rest!r}", _ONLY_ASSIGNMENTS)

    # -- words and expansions -----------------------------------------------------------------------

    def word(self, mode: str) -> str:
        """Read and expand one word. mode: 'top' (ends at blank or ';'), 'brace' (ends at '}'), 'arith' (all)."""
        out: list[str] = []
        text = self.text
        while self.pos < self.n:
            c = text[self.pos]
            if mode == "top" and c in " \t;":
                break
            if mode == "brace" and c == "}":
                break
            if c == "$":
                out.append(self.dollar())
            elif c == "`":
                raise self.error("command substitution with backticks is not allowed in a CONFIG block", _ONLY_ASSIGNMENTS)
            elif mode == "arith":
                out.append(c)
                self.pos += 1
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.error("unterminated single quote", "close the quote on the same line")
                out.append(text[self.pos + 1:end])
                self.pos = end + 1
            elif c == '"':
                out.append(self.double_quoted())
            elif c == "\\":
                if self.pos + 1 < self.n:
                    out.append(text[self.pos + 1])
                self.pos += 2
            elif mode == "top" and c in "|&<>()":
                raise self.error(f"shell operator {c!r} is not allowed in a CONFIG block", _ONLY_ASSIGNMENTS)
            else:
                out.append(c)
                self.pos += 1
        return "".join(out)

    def double_quoted(self) -> str:
        out: list[str] = []
        text = self.text
        self.pos += 1
        while self.pos < self.n:
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                return "".join(out)
            if c == "\\" and self.pos + 1 < self.n and text[self.pos + 1] in '$`"\\':
                out.append(text[self.pos + 1])
                self.pos += 2
            elif c == "$":
                out.append(self.dollar())
            elif c == "`":
                raise self.error("command substitution with backticks is not allowed in a CONFIG block", _ONLY_ASSIGNMENTS)
            else:
                out.append(c)
                self.pos += 1
        raise self.error("unterminated double quote", "close the quote on the same line")

    def dollar(self) -> str:
        text = self.text
        nxt = text[self.pos + 1] if self.pos + 1 < self.n else ""
        if text.startswith("$((", self.pos):
            return self.arithmetic()
        if nxt == "(":
            raise self.error("command substitution $(...) is not allowed in a CONFIG block",
                             "write the value literally; gymv reads the block without running it")
        if nxt == "{":
            return self.braced()
        m = _NAME.match(text, self.pos + 1)
        if m:
            self.pos = m.end()
            return self.lookup(m.group())
        if nxt and (nxt.isdigit() or nxt in "@*#?$!-"):
            raise self.error(f"special parameter ${nxt} is not known in a CONFIG block",
                             "use only variables set earlier in the block")
        self.pos += 1
        return "$"

    def lookup(self, name: str) -> str:
        value = self.scope.values.get(name)
        if value is None:
            raise self.error(f"unknown variable {name!r}",
                             f"set {name} earlier in the CONFIG block, or write ${{{name}:-default}}")
        return value

    def braced(self) -> str:
        text = self.text
        m = _NAME.match(text, self.pos + 2)
        if not m:
            end = text.find("}", self.pos)
            shown = text[self.pos:end + 1] if end >= 0 else text[self.pos:]
            raise self.error(f"unsupported parameter expansion {shown!r}", "use ${NAME} or ${NAME:-default}")
        name = m.group()
        self.pos = m.end()
        if self.pos < self.n and text[self.pos] == "}":
            self.pos += 1
            return self.lookup(name)
        for op in (":-", ":=", "-", "="):
            if text.startswith(op, self.pos):
                self.pos += len(op)
                default = self.word("brace")
                if self.pos >= self.n:
                    raise self.error(f"unterminated ${{{name}{op}...", "close it with '}'")
                self.pos += 1
                current = self.scope.values.get(name)
                use_default = current is None or (op.startswith(":") and current == "")
                if not use_default:
                    return current
                if op.endswith("="):
                    self.scope.set(name, default, self.where)
                return default
        end = text.find("}", self.pos)
        shown = text[m.start() - 2:end + 1] if end >= 0 else text[m.start() - 2:]
        raise self.error(f"unsupported parameter expansion {shown!r}", "use ${NAME} or ${NAME:-default}")

    def arithmetic(self) -> str:
        text = self.text
        start = self.pos + 3
        depth = 0
        i = start
        while i < self.n:
            c = text[i]
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    if i + 1 < self.n and text[i + 1] == ")":
                        break
                    raise self.error(f"malformed arithmetic {text[self.pos:i + 1]!r}: unbalanced ')'", arith.OPERATORS_HELP)
                depth -= 1
            i += 1
        else:
            raise self.error("unterminated $(( arithmetic", "close it with '))' on the same line")
        inner = _Line(text[start:i], self.where, self.scope, self.assigned, self.lineno)
        expanded = inner.word("arith")
        self.pos = i + 2
        value = arith.evaluate(expanded, self.scope.values.get, where=self.where)
        return str(value)
