"""Bounded work on untrusted YAML, for every reader (recipes, overrides, a run's config.yaml, suite files).

Aliases let ~500 bytes stand for billions of values (an "alias bomb"), and every consumer that walks or
copies the result pays for the expansion; nesting depth costs recursion. A composed document is measured
before anything is built from it: its size with every alias expanded is computed over distinct nodes
(linear in the text, however large the expansion), and one over the caps is refused.
"""

from __future__ import annotations

from typing import Any

import yaml

from gymv.errors import GymvError

MAX_VALUES = 200_000  # a recipe holds hundreds of values
MAX_DEPTH = 100

_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def expanded_size(node: yaml.Node, memo: dict[int, int] | None = None, depth: int = 0) -> int:
    """How many values `node` stands for once every alias is expanded; MAX_VALUES + 1 means "too many"
    (or too deep, or an alias that contains itself)."""
    memo = {} if memo is None else memo
    known = memo.get(id(node))
    if known is not None:
        return known
    if depth > MAX_DEPTH:
        return MAX_VALUES + 1
    memo[id(node)] = MAX_VALUES + 1
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(expanded_size(k, memo, depth + 1) + expanded_size(v, memo, depth + 1) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(expanded_size(v, memo, depth + 1) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size = min(size, MAX_VALUES + 1)
    return size


def check_bounds(node: yaml.Node | None, where: str) -> None:
    if node is not None and expanded_size(node) > MAX_VALUES:
        raise GymvError(f"the YAML expands to more than {MAX_VALUES} values, or nests more than {MAX_DEPTH} "
                        "levels deep (aliases repeating aliases?)", where=where,
                        fix="write the values out instead of nesting `*alias` references")


def safe_load(text: str, where: str) -> Any:
    """yaml.safe_load with the bounds above; any problem is one GymvError at `where`."""
    loader = _SafeLoader(text)
    try:
        node = loader.get_single_node()
        check_bounds(node, where)
        return None if node is None else loader.construct_document(node)
    except RecursionError:
        raise GymvError("the YAML nests too deeply to read", where=where, fix="flatten the structure") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"{where}:{mark.line + 1}" if mark else where
        raise GymvError(f"YAML syntax error: {e.problem or e.context or 'invalid YAML'}", where=loc,
                        fix="fix the YAML syntax") from None
    except (yaml.YAMLError, ValueError) as e:
        raise GymvError(f"YAML error: {str(e).split(';')[0]}", where=where, fix="fix the YAML") from None
    finally:
        loader.dispose()
