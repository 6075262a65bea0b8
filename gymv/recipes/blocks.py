"""A driver's marked comment blocks: `# ===== BEGIN NAME =====` ... `# ===== END NAME =====`.

The CONFIG block (run sizing) and the CHECKS block (a full run's metric checks) follow one rule, found here
once: at most one block of a name per driver, BEGIN before END, and every malformed marker an error at its
line, so the two readers never disagree on what a block is.
"""

from __future__ import annotations

from collections.abc import Sequence

from gymv.errors import GymvError


def begin_marker(name: str) -> str:
    return f"# ===== BEGIN {name} ====="


def end_marker(name: str) -> str:
    return f"# ===== END {name} ====="


def find_marked_block(lines: Sequence[str], name: str, shown: str) -> tuple[int, int] | None:
    """The 1-based line numbers of the NAME block's BEGIN and END markers, or None when there is no block.

    `shown` is the file as errors name it; a second marker, an END before BEGIN or a BEGIN never closed is
    a GymvError at that line.
    """
    begin_line, end_line = begin_marker(name), end_marker(name)
    begin = end = None
    for n, raw in enumerate(lines, 1):
        s = raw.strip()
        if s == begin_line:
            if begin is not None:
                raise GymvError(f"second BEGIN {name} marker (the first is on line {begin})", where=f"{shown}:{n}",
                                fix=f"keep exactly one {name} block per driver")
            begin = n
        elif s == end_line:
            if begin is None:
                raise GymvError(f"END {name} marker before any BEGIN {name} marker", where=f"{shown}:{n}",
                                fix=f"put '{begin_line}' above it")
            if end is not None:
                raise GymvError(f"second END {name} marker (the first is on line {end})", where=f"{shown}:{n}",
                                fix=f"keep exactly one {name} block per driver")
            end = n
    if begin is None:
        return None
    if end is None:
        raise GymvError(f"{name} block has no END marker", where=f"{shown}:{begin}",
                        fix=f"close the block with a '{end_line}' line")
    return begin, end
