"""Validate tool-call arguments against a tool's JSON schema (the subset function tools use).

Models send arguments of the wrong type often (lists for integers, strings for numbers); the message
produced here goes back to the model as the tool result, so it names the argument and what was expected.
Supported keywords: type (including lists of types), properties, required, additionalProperties, items,
enum, minimum, maximum, minItems, maxItems, minLength, maxLength.
"""

from __future__ import annotations

import math
from typing import Any


class SchemaError(ValueError):
    pass


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_type(value: Any, t: str) -> bool:
    actual = _json_type(value)
    if t == "number":
        return actual in ("integer", "number") and not (isinstance(value, float) and not math.isfinite(value))
    if t == "integer":
        return actual == "integer" or (actual == "number" and math.isfinite(value) and float(value).is_integer())
    return actual == t


def _article(t: str) -> str:
    return ("an " if t[0] in "aeiou" else "a ") + t


def validate_arguments(args: Any, schema: dict) -> Any:
    """Return `args` (integral floats given for integers become ints) or raise SchemaError."""
    return _validate(args, schema, "arguments")


def _validate(value: Any, schema: dict, path: str) -> Any:
    if not isinstance(schema, dict):
        return value
    types = schema.get("type")
    if types is not None:
        types_list = types if isinstance(types, list) else [types]
        if not any(_is_type(value, t) for t in types_list):
            want = " or ".join(_article(t) for t in types_list)
            raise SchemaError(f"{path} must be {want}, got {_article(_json_type(value))}: {_short(value)}")
        if isinstance(value, float) and "integer" in types_list and "number" not in types_list:
            value = int(value)
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{path} must be one of {schema['enum']}, got {_short(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise SchemaError(f"{path} must be at least {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise SchemaError(f"{path} must be at most {schema['maximum']}, got {value}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise SchemaError(f"{path} must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise SchemaError(f"{path} must have at most {schema['maxLength']} characters")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            raise SchemaError(f"{path} must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise SchemaError(f"{path} must have at most {schema['maxItems']} items")
        if isinstance(schema.get("items"), dict):
            value = [_validate(v, schema["items"], f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                raise SchemaError(f"missing required argument {key!r}" if path == "arguments"
                                  else f"{path} is missing {key!r}")
        extra = [k for k in value if k not in props]
        if extra and schema.get("additionalProperties") is False:
            allowed = ", ".join(props) or "none"
            raise SchemaError(f"unexpected argument {extra[0]!r} (allowed: {allowed})" if path == "arguments"
                              else f"{path} has unexpected key {extra[0]!r}")
        out = {}
        for k, v in value.items():
            sub = props.get(k)
            out[k] = _validate(v, sub, f"argument {k!r}" if path == "arguments" else f"{path}.{k}") if sub else v
        value = out
    return value


def _short(value: Any) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
