"""Read a test-suite driver's CONFIG block (never executing it) into the numbers that size its runs.

A driver is a bash script holding a block between `# ===== BEGIN CONFIG =====` and
`# ===== END CONFIG =====`. Every driver is read in a fresh scope, so one script's values never leak into
the next (the bug of sourcing blocks one after another in one shell). A wrapper driver may set its own block
and then `exec` another driver; the driver it execs is read with the wrapper's *exported* variables as its
environment, exactly what bash would hand it, and the pair counts once, under the wrapper. An `export NAME`
(or `export NAME=value`) line between the block and the `exec` counts as bash would count it: NeMo RL's
wrappers set their sizing in the block and export it just before they exec.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from gymv.errors import GymvError
from gymv.recipes import arith
from gymv.recipes.blocks import begin_marker, end_marker, find_marked_block
from gymv.recipes.shell import Scope, run_block

BEGIN_MARKER = begin_marker("CONFIG")
END_MARKER = end_marker("CONFIG")
REQUIRED_KEYS = ("NUM_NODES", "STEPS_PER_RUN", "MAX_STEPS", "NUM_MINUTES")
INTEGER_KEYS = ("NUM_NODES", "GPUS_PER_NODE", "STEPS_PER_RUN", "MAX_STEPS", "NUM_RUNS", "NUM_MINUTES")
DEFAULT_GPUS_PER_NODE = 8

# Ways a script names its own directory; `exec "<one of these>/other.sh"` is a wrapper exec.
_SELF = r'(?:"?(?:\$0|\$\{0\}|\$\{BASH_SOURCE\[0\]\}|\$\{BASH_SOURCE\}|\$BASH_SOURCE)"?)'
_DIRNAME = rf"\$\(\s*dirname\s+(?:--\s+)?{_SELF}\s*\)"
_SCRIPT_DIR_IDIOMS = [
    re.compile(rf'\$\(\s*cd\s+(?:--\s+)?"?{_DIRNAME}"?\s*(?:(?:2>&1|&>|>&|2>|>)\s*(?:/dev/null)?\s*)*&&\s*pwd(?:\s+-P)?\s*\)'),
    re.compile(_DIRNAME),
    re.compile(r"\$\{(?:0|BASH_SOURCE\[0\]|BASH_SOURCE)%/\*\}"),
]
_DIR_TOKEN = "\x00SCRIPT_DIR\x00"
_ASSIGN_OUTSIDE = re.compile(r"^\s*(?:export\s+|readonly\s+|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_EXPORT = re.compile(r"^\s*export\s")
_EXPORTED_NAME = re.compile(r"(?:^|[\s;])(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)(?==|\s|;|$)")


@dataclass(frozen=True)
class ConfigBlock:
    """Where a driver's CONFIG block is, its lines, and the driver it `exec`s afterwards (if any)."""

    path: Path
    begin_line: int
    end_line: int
    lines: tuple[tuple[int, str], ...]
    exec_target: Path | None = None
    exec_line: int | None = None
    # `export ...` lines after the block and before the exec (a wrapper's hand-over of its values)
    exports: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class IgnoredValue:
    """A value a wrapper sets that the driver it execs does not run with (lint reports these)."""

    name: str
    wrapper_value: str
    effective_value: str | None
    where: str
    reason: str

    def message(self) -> str:
        effective = "unset" if self.effective_value is None else repr(self.effective_value)
        return f"{self.name}={self.wrapper_value!r} does not reach the driver it execs ({self.reason}); it runs with {effective}"


@dataclass(frozen=True)
class DriverConfig:
    """The effective run sizing of one driver (for a wrapper: of the driver chain it execs)."""

    path: Path
    num_nodes: int
    gpus_per_node: int
    steps_per_run: int
    max_steps: int
    num_runs: int
    num_minutes: int
    extras: dict[str, str] = field(default_factory=dict)
    chain: tuple[Path, ...] = ()
    defaulted: frozenset[str] = frozenset()
    sources: dict[str, str] = field(default_factory=dict)
    ignored_wrapper_values: tuple[IgnoredValue, ...] = ()
    # what the launcher allocates: a wrapper's own CONFIG block is what it reads, so where the driver it execs
    # runs with other values (a warning), GPU-hours still count the wrapper's (NUM_NODES, GPUS_PER_NODE,
    # NUM_RUNS, NUM_MINUTES); empty when the two agree
    allocated: dict[str, int] = field(default_factory=dict)

    def allocation(self, key: str) -> int:
        effective = {"NUM_NODES": self.num_nodes, "GPUS_PER_NODE": self.gpus_per_node, "NUM_RUNS": self.num_runs,
                     "NUM_MINUTES": self.num_minutes}[key]
        return self.allocated.get(key, effective)

    @property
    def gpu_minutes(self) -> int:
        """Exact: NUM_RUNS × NUM_NODES × GPUS_PER_NODE × NUM_MINUTES as allocated (always a whole number)."""
        return (self.allocation("NUM_RUNS") * self.allocation("NUM_NODES") * self.allocation("GPUS_PER_NODE")
                * self.allocation("NUM_MINUTES"))

    @property
    def gpu_hours(self) -> Fraction:
        return Fraction(self.gpu_minutes, 60)

    @property
    def gpus(self) -> int:
        return self.allocation("NUM_NODES") * self.allocation("GPUS_PER_NODE")


def _read(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise GymvError("driver not found", where=str(path), fix="check the path") from None
    except UnicodeDecodeError:
        raise GymvError("driver is not UTF-8 text", where=str(path), fix="save the script as UTF-8") from None
    except OSError as e:
        raise GymvError(f"cannot read driver: {e.strerror}", where=str(path),
                        fix="check that the driver file exists and is readable") from None


def find_block(path: str | Path) -> ConfigBlock:
    """Locate the CONFIG block and any wrapper `exec`; errors name the file and line."""
    path = Path(path)
    lines = _read(path)
    block = find_marked_block(lines, "CONFIG", str(path))
    if block is None:
        raise GymvError("no CONFIG block", where=f"{path}:1",
                        fix=f"add the run sizing between '{BEGIN_MARKER}' and '{END_MARKER}' lines")
    begin, end = block
    body = tuple((i, lines[i - 1]) for i in range(begin + 1, end))
    outside = [(i, raw) for i, raw in enumerate(lines, 1) if i < begin or i > end]
    target, exec_line = _find_exec(path, outside)
    exports = () if exec_line is None else tuple(
        (i, lines[i - 1]) for i in range(end + 1, exec_line) if _EXPORT.match(lines[i - 1]))
    return ConfigBlock(path, begin, end, body, target, exec_line, exports)


def _find_exec(path: Path, outside: list[tuple[int, str]]) -> tuple[Path | None, int | None]:
    """The `.sh` driver that `exec` hands over to, resolved like the script would (its own directory first)."""
    dir_vars: set[str] = set()
    found: tuple[Path, int] | None = None
    for lineno, raw in outside:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _ASSIGN_OUTSIDE.match(line)
        if m and _is_script_dir(m.group(2).strip()):
            dir_vars.add(m.group(1))
            continue
        if not re.match(r"exec\s", line):
            continue
        words = _split_exec(line[4:], dir_vars)
        if words is None:
            continue
        if not words:
            continue
        if found is not None:
            raise GymvError(f"more than one exec of another driver (the first is on line {found[1]})",
                            where=f"{path}:{lineno}", fix="a wrapper execs exactly one driver")
        target = words[0]
        if "$" in target or "`" in target:
            raise GymvError(f"cannot resolve the driver this wrapper execs: {target!r}", where=f"{path}:{lineno}",
                            fix='write exec "$(dirname "$0")/other.sh" "$@" or a path relative to this driver')
        found = (_resolve_target(path, target, lineno), lineno)
    return (found[0], found[1]) if found else (None, None)


def _is_script_dir(expr: str) -> bool:
    expr = expr.strip()
    if len(expr) >= 2 and expr[0] == expr[-1] == '"':
        expr = expr[1:-1]
    return any(p.fullmatch(expr) for p in _SCRIPT_DIR_IDIOMS)


def _split_exec(rest: str, dir_vars: set[str]) -> list[str] | None:
    """Words of an `exec` line with script-dir idioms replaced, or None when it does not exec a `.sh` driver."""
    for pattern in _SCRIPT_DIR_IDIOMS:
        rest = pattern.sub(_DIR_TOKEN, rest)
    for name in dir_vars:
        rest = re.sub(rf"\$\{{{name}\}}|\${name}(?![A-Za-z0-9_])", _DIR_TOKEN, rest)
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:
        return None
    while words and words[0] in ("bash", "sh", "/bin/bash", "/usr/bin/env", "env"):
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if not words or not words[0].endswith(".sh") or words[0][:1] in "<>" or re.match(r"\d*[<>]", words[0]):
        return None
    return words


def _resolve_target(path: Path, target: str, lineno: int) -> Path:
    if target.startswith(_DIR_TOKEN):
        candidates = [path.parent / target[len(_DIR_TOKEN):].lstrip("/")]
    elif Path(target).is_absolute():
        candidates = [Path(target)]
    else:
        candidates = [path.parent / target, Path(target)]
    for c in candidates:
        if c.is_file():
            return c
    shown = str(candidates[0]).replace(_DIR_TOKEN, "")
    raise GymvError(f"the driver this wrapper execs does not exist: {shown}", where=f"{path}:{lineno}",
                    fix="fix the exec path (relative paths resolve from the wrapper's directory)")


def parse_driver(path: str | Path, env: dict[str, str] | None = None) -> DriverConfig:
    """Parse a driver (following wrapper `exec`s) into its effective sizing, in a scope of its own.

    `env` plays the exported environment the driver starts with (default: nothing, never os.environ).
    """
    path = Path(path)
    scope = Scope.inherited(env or {})
    chain: list[Path] = []
    seen: set[Path] = set()
    wrapper_sets: dict[str, tuple[str, str]] = {}
    unexported: set[str] = set()
    exported_anew: dict[str, tuple[str, str]] = {}  # a block value a later `export NAME=...` changed: (value, where)
    current: Path = path
    block = find_block(current)
    listed_own: dict[str, str] = {}
    while True:
        chain.append(current)
        assigned = run_block(block.lines, scope, str(current))
        if len(chain) == 1:
            listed_own = {name: scope.values[name] for name, _ in assigned if name in scope.values}
        if block.exec_target is None:
            break
        seen.add(current.resolve())
        block_sets = {name: (scope.values[name], scope.origin[name]) for name, _ in assigned}
        _run_exports(block, scope, set(block_sets), str(current))
        for name, value in block_sets.items():
            wrapper_sets[name] = value
            if scope.values[name] != value[0]:
                exported_anew[name] = (scope.values[name], scope.origin[name])
            if name not in scope.exported:
                unexported.add(name)
            else:
                unexported.discard(name)
        callee = block.exec_target
        if callee.resolve() in seen:
            raise GymvError(f"exec cycle: {callee} is already in the chain {' -> '.join(map(str, chain))}",
                            where=f"{current}:{block.exec_line}", fix="a wrapper must exec a driver that does not exec it back")
        scope = Scope.inherited(scope.exported_values(), scope.origin)
        current = callee
        block = find_block(current)
    config = _effective(path, block, scope, tuple(chain), wrapper_sets, unexported, exported_anew)
    if len(chain) == 1 or not any(scope.values.get(k) != v for k, v in listed_own.items()):
        return config
    return replace(config, allocated=_allocated(config, path, {**scope.values, **listed_own}))


def _run_exports(block: ConfigBlock, scope: Scope, block_names: set[str], label: str) -> None:
    """Apply the wrapper's `export` lines between its block and its exec to `scope`, as bash would.

    A line that cannot be read without running it (`export EXP_NAME="$(basename "$0")"`) is skipped unless it
    exports a value the block set: what the exec'd driver gets would then be unknown, and is an error.
    """
    for lineno, text in block.exports:
        trial = Scope(dict(scope.values), set(scope.exported), dict(scope.origin))
        try:
            run_block([(lineno, text)], trial, label)
        except GymvError as e:
            names = set(_EXPORTED_NAME.findall(text.split("#", 1)[0])) & block_names
            if names:
                raise GymvError(f"cannot read what this line exports for {', '.join(sorted(names))} without running "
                                f"it ({e.message})", where=f"{label}:{lineno}",
                                fix="set the value in the CONFIG block and export it by name (export NAME)") from None
            continue
        scope.values, scope.exported, scope.origin = trial.values, trial.exported, trial.origin


ALLOCATED_KEYS = ("NUM_NODES", "GPUS_PER_NODE", "NUM_RUNS", "NUM_MINUTES")


def _allocated(config: DriverConfig, path: Path, values: dict[str, str]) -> dict[str, int]:
    """The sizing the launcher reads from the listed driver's own block (where it differs from the run's)."""
    numbers: dict[str, int] = {}
    for key in ("NUM_NODES", "GPUS_PER_NODE", "NUM_RUNS", "NUM_MINUTES", "STEPS_PER_RUN", "MAX_STEPS"):
        n = arith.parse_integer(values[key]) if key in values else None
        if key in values and (n is None or n < (0 if key == "GPUS_PER_NODE" else 1)):
            raise GymvError(f"{key}={values[key]!r} in the wrapper's CONFIG block is not a valid count", where=str(path),
                            fix=f"set {key} to a whole number")
        if n is not None:
            numbers[key] = n
    if "NUM_RUNS" not in numbers and "MAX_STEPS" in numbers and "STEPS_PER_RUN" in numbers:
        numbers["NUM_RUNS"] = -(-numbers["MAX_STEPS"] // numbers["STEPS_PER_RUN"])
    return {k: numbers[k] for k in ALLOCATED_KEYS if k in numbers and numbers[k] != config.allocation(k)}


def _effective(path: Path, block: ConfigBlock, scope: Scope, chain: tuple[Path, ...],
               wrapper_sets: dict[str, tuple[str, str]], unexported: set[str],
               exported_anew: dict[str, tuple[str, str]]) -> DriverConfig:
    values, origin = scope.values, scope.origin
    via = f" (reached by exec from {chain[0]})" if len(chain) > 1 else ""
    block_where = f"{block.path}:{block.begin_line}"
    for key in REQUIRED_KEYS:
        if key not in values:
            raise GymvError(f"CONFIG block does not set {key}{via}", where=block_where,
                            fix=f"add {key}=<integer> between the CONFIG markers")
    numbers: dict[str, int] = {}
    defaulted: set[str] = set()
    for key in INTEGER_KEYS:
        if key not in values:
            continue
        n = arith.parse_integer(values[key])
        if n is None:
            leading_zero = re.fullmatch(r"[+-]?0\d+", values[key].strip()) is not None
            raise GymvError(
                f"{key}={values[key]!r} is not an integer{via}" + (" (a leading 0 reads as octal in bash)" if leading_zero else ""),
                where=origin.get(key, block_where), fix=f"set {key} to a whole number such as 8",
            )
        least = 0 if key == "GPUS_PER_NODE" else 1  # 0 GPUs per node is a CPU-only (`1n0g`) recipe
        if n < least:
            raise GymvError(f"{key}={n} must be {least} or more{via}", where=origin.get(key, block_where),
                            fix=f"set {key} to {least} or more")
        numbers[key] = n
    if "GPUS_PER_NODE" not in numbers:
        numbers["GPUS_PER_NODE"] = DEFAULT_GPUS_PER_NODE
        defaulted.add("GPUS_PER_NODE")
    if "NUM_RUNS" not in numbers:
        numbers["NUM_RUNS"] = -(-numbers["MAX_STEPS"] // numbers["STEPS_PER_RUN"])
        defaulted.add("NUM_RUNS")
    ignored = []
    for name, (value, where) in wrapper_sets.items():
        effective = values.get(name)
        if effective == value:
            continue
        anew = exported_anew.get(name)
        at = anew[1] if anew and anew[0] == effective else origin.get(name, "?")
        reason = "not exported" if name in unexported else f"reassigned at {at}"
        ignored.append(IgnoredValue(name, value, effective, where, reason))
    extras = {k: v for k, v in values.items() if k not in INTEGER_KEYS}
    return DriverConfig(
        path=path,
        num_nodes=numbers["NUM_NODES"],
        gpus_per_node=numbers["GPUS_PER_NODE"],
        steps_per_run=numbers["STEPS_PER_RUN"],
        max_steps=numbers["MAX_STEPS"],
        num_runs=numbers["NUM_RUNS"],
        num_minutes=numbers["NUM_MINUTES"],
        extras=extras,
        chain=chain,
        defaulted=frozenset(defaulted),
        sources={k: origin[k] for k in values if k in origin},
        ignored_wrapper_values=tuple(ignored),
    )
