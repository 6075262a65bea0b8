"""JSON from a client, with every number bounded in size.

A number literal is text of any length; Python refuses to make an int of more than 4,300 digits (and a long
one costs quadratic time below that), so a body with one such number would fail deep inside whoever reads
it. Here a literal over `MAX_NUMBER_CHARS` is refused at parse time, naming where it sits in the body.
"""

from __future__ import annotations

import json
from typing import Any

MAX_NUMBER_CHARS = 1000  # token ids, counts, coordinates and logprobs are tens of characters


class NumberTooLong(ValueError):
    """`loc` is the path to the number (keys and list indices), as FastAPI's error locations are."""

    def __init__(self, loc: list[str | int], length: int):
        self.loc, self.length = loc, length
        where = ".".join(map(str, loc)) or "the body"
        super().__init__(f"the number at {where} has {length} characters, over the limit of {MAX_NUMBER_CHARS}")


class _Long(str):
    """A number literal left unparsed because it is too long."""


def _find_long(value: Any, loc: list[str | int]) -> list[str | int] | None:
    if isinstance(value, _Long):
        return loc
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _find_long(item, [*loc, key])
        if found is not None:
            return found
    return None


def loads(text: str | bytes) -> Any:
    """`json.loads`, raising NumberTooLong for an over-long number (json.JSONDecodeError, RecursionError as
    json.loads raises them)."""
    lengths: list[int] = []

    def bounded(parse):
        def read(literal: str) -> Any:
            if len(literal) > MAX_NUMBER_CHARS:
                lengths.append(len(literal))
                return _Long(literal)
            return parse(literal)
        return read

    value = json.loads(text, parse_int=bounded(int), parse_float=bounded(float))
    if lengths:
        raise NumberTooLong(_find_long(value, []) or [], lengths[0])
    return value
