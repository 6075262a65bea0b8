"""Read YAML recipe files keeping the line of every key, so errors and lint can point at `file:line`."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from gymv.errors import GymvError
from gymv.yaml_bounds import MAX_DEPTH, MAX_VALUES, check_bounds

KeyPath = tuple  # tuple[str | int, ...]


class Origin(NamedTuple):
    """Where a config value was written: a file (or "<command line>") and a 1-based line (None if unknown)."""

    file: str
    line: int | None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


_DISPLAY: dict[tuple[str, str], str] = {}


@lru_cache(maxsize=8)
def _resolved_cwd(cwd: str) -> Path:
    return Path(cwd).resolve()


def display_path(path: str | os.PathLike) -> str:
    """A path relative to the working directory when it lies below it, else absolute."""
    key = (os.fspath(path), os.getcwd())
    shown = _DISPLAY.get(key)
    if shown is None:
        p = Path(path).resolve()
        try:
            shown = str(p.relative_to(_resolved_cwd(key[1])))
        except ValueError:
            shown = str(p)
        if len(_DISPLAY) < 100_000:
            _DISPLAY[key] = shown
    return shown


class _SafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml when present: lint reads hundreds of files
    """SafeLoader that also reads `1e-6` as a float (YAML 1.1 requires a dot; recipes are full of such numbers)."""


_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Budget:
    def __init__(self, where: str):
        self.where, self.left = where, MAX_VALUES

    def spend(self, node: yaml.Node, depth: int) -> None:
        self.left -= 1
        if self.left < 0:
            raise GymvError(f"the YAML expands to more than {MAX_VALUES} values (aliases repeating aliases?)",
                            where=f"{self.where}:{node.start_mark.line + 1}",
                            fix="write the values out instead of nesting `*alias` references")
        if depth > MAX_DEPTH:
            raise GymvError(f"the YAML nests more than {MAX_DEPTH} levels deep", where=f"{self.where}:{node.start_mark.line + 1}",
                            fix="flatten the structure")


class YamlDoc(NamedTuple):
    data: Any
    lines: dict  # KeyPath -> 1-based line of the key (or list item)


def _build(node: yaml.Node, loader: _SafeLoader, prefix: KeyPath, lines: dict, where: str, budget: _Budget) -> Any:
    budget.spend(node, len(prefix))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for k_node, _ in node.value:
            if k_node.tag == _MERGE_TAG:
                continue
            key = loader.construct_object(k_node, deep=True)
            line = k_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                dotted = ".".join(map(str, prefix + (key,)))
                raise GymvError(f"duplicate key {dotted!r} (first written on line {seen[key]})",
                                where=f"{where}:{line}", fix="keep one of the two")
            seen[key] = line
        loader.flatten_mapping(node)
        out: dict[str, Any] = {}
        for k_node, v_node in node.value:
            key = loader.construct_object(k_node, deep=True)
            line = k_node.start_mark.line + 1
            if not isinstance(key, str):
                raise GymvError(f"key {key!r} is a {type(key).__name__}, keys must be strings",
                                where=f"{where}:{line}", fix=f"quote it: '{key}'")
            path = prefix + (key,)
            lines[path] = line
            out[key] = _build(v_node, loader, path, lines, where, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            lines[prefix + (i,)] = item.start_mark.line + 1
            items.append(_build(item, loader, prefix + (i,), lines, where, budget))
        return items
    return loader.construct_object(node, deep=True)


def parse_yaml(text: str, where: str) -> YamlDoc:
    """Parse one YAML document; syntax errors become a GymvError at `where:line:col`."""
    loader = _SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict = {}
        check_bounds(node, where)
        data = None if node is None else _build(node, loader, (), lines, where, _Budget(where))
    except RecursionError:
        raise GymvError("the YAML nests too deeply to read", where=where, fix="flatten the structure") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise GymvError(f"a value cannot be read: {str(e).split(';')[0]}", where=where,
                        fix="shorten that value") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        problem = e.problem or e.context or "invalid YAML"
        raise GymvError(f"YAML syntax error: {problem}", where=loc,
                        fix="check indentation, quoting and ':' at that spot") from None
    except yaml.YAMLError as e:
        raise GymvError(f"YAML error: {e}", where=where, fix="fix the YAML") from None
    finally:
        loader.dispose()
    return YamlDoc(data, lines)


def read_yaml_mapping(path: str | os.PathLike) -> YamlDoc:
    """Read a file whose root must be a mapping (every recipe is)."""
    path = Path(path)
    where = display_path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or device would block or never end
        raise GymvError("is not a regular file", where=where, fix="point at a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GymvError("file not found", where=where, fix="check the path") from None
    except IsADirectoryError:
        raise GymvError("is a directory, expected a YAML file", where=where,
                        fix="pass the path of a YAML file") from None
    except OSError as e:
        raise GymvError(f"cannot read: {e.strerror}", where=where,
                        fix="check that the file exists and is readable") from None
    except UnicodeDecodeError:
        raise GymvError("not UTF-8 text", where=where, fix="save the file as UTF-8") from None
    doc = parse_yaml(text, where)
    if not isinstance(doc.data, dict):
        kind = "empty" if doc.data is None else f"a {type(doc.data).__name__}"
        raise GymvError(f"the top level is {kind}, a recipe must be a mapping of keys", where=f"{where}:1",
                        fix="write `key: value` lines at the top level (e.g. `algorithm: grpo`)")
    return doc


def parse_scalar(text: str) -> Any:
    """Parse one command-line value the way YAML reads a flow value: `8`, `1e-5`, `null`, `[1,2]`, `{a: 1}`."""
    if text == "":
        return ""
    doc = parse_yaml(text, f"value {text!r}")
    return doc.data

