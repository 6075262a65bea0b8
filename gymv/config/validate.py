"""Schema validation whose every complaint names the dotted key, the file:line that wrote it, and a fix."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from gymv.findings import Finding, raise_first_error
from gymv.config.schema import ALGORITHM_SECTIONS, ALGORITHMS, MODELS, RecipeBase, base_algorithm, is_vlm
from gymv.config.nemo_rl import nemo_rl_names
from gymv.config.tree import dotted, get_path, suggest
from gymv.yamlfile import KeyPath, Origin

Locate = Callable[[KeyPath], "Origin | str | None"]


def _unwrap(tp: Any) -> Any:
    """Strip Annotated/Optional so the walker sees the model, dict or Literal underneath."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
            if models:
                tp = models[0]
            elif len(members) == 1:
                tp = members[0]
            else:
                return tp
        else:
            return tp


def _field_names(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f.annotation for name, f in model.model_fields.items()}


def annotation_at(model: type[BaseModel], path: KeyPath) -> Any:
    """The (unwrapped) type the schema expects at `path`, or None when the path is not in the schema."""
    tp: Any = model
    for p in path:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            fields = _field_names(tp)
            if p not in fields:
                return None
            tp = fields[p]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    return _unwrap(tp)


def keys_at(model: type[BaseModel], path: KeyPath) -> list[str]:
    tp = annotation_at(model, path)
    return list(_field_names(tp)) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key the schema knows (`mopd.teachers.<alias>.path` for mapping entries); docs and tests use it."""
    out = []
    for name, ann in _field_names(model).items():
        key = f"{prefix}{name}"
        out.append(key)
        tp = _unwrap(ann)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out += schema_keys(tp, key + ".")
        elif typing.get_origin(tp) is dict:
            val = _unwrap(typing.get_args(tp)[1])
            if isinstance(val, type) and issubclass(val, BaseModel):
                out += schema_keys(val, key + ".<alias>.")
    return out


def _clean_loc(data: Any, loc: tuple) -> KeyPath:
    """Keep the part of a pydantic location that names keys in the data (drops union tags like 'list[str]')."""
    node, out = data, []
    for p in loc:
        if isinstance(node, dict) and isinstance(p, str):
            out.append(p)
            if p not in node:
                break
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            out.append(p)
            node = node[p]
        else:
            break
    return tuple(out)


def _data_path(data: Any, path: KeyPath) -> KeyPath:
    """The longest start of `path` that names a value in `data` (a type error's location may go on into union
    tags such as 'str')."""
    node, out = data, []
    for p in path:
        if not isinstance(node, dict) or p not in node:
            break
        out.append(p)
        node = node[p]
    return tuple(out)


def _where(locate: Locate | None, path: KeyPath, fallback: str | None) -> str | None:
    if locate is not None:
        o = locate(path)
        if o:
            return str(o)
    return fallback


def _choices(tp: Any) -> list[Any]:
    return list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else []


def _errors_to_findings(model: type[BaseModel], data: dict, err: ValidationError, locate: Locate | None,
                        fallback: str | None) -> list[Finding]:
    grouped: dict[tuple, list[dict]] = {}
    for e in err.errors():
        grouped.setdefault((_clean_loc(data, e["loc"]), e["type"] == "extra_forbidden"), []).append(e)
    findings = []
    hinted: set[KeyPath] = set()
    for (path, extra), errs in grouped.items():
        key = dotted(path)
        where = _where(locate, path, fallback)
        e = errs[0]
        if not extra:
            # a mapping where gymv takes a value: NeMo RL's `logger.wandb: {project: ...}`, `data.train: {...}`
            at = _data_path(data, path)
            value = get_path(data, at, None)
            nemo = nemo_rl_names(at, value, base_algorithm(str(data.get("algorithm")))) if (
                isinstance(value, dict) and at not in hinted) else []
            if nemo:
                hinted.add(at)
                findings += [Finding("schema.unknown-key", f"unknown key `{dotted(p)}`" if p != at else
                                     f"`{dotted(p)}` is a mapping, NeMo RL's form", dotted(p),
                                     _where(locate, p, fallback), fix) for p, fix in nemo]
                continue
            if at in hinted:
                continue
        if extra:
            section, name = path[:-1], path[-1]
            nemo = nemo_rl_names(path, get_path(data, path, None), base_algorithm(str(data.get("algorithm"))))
            if nemo:
                findings += [Finding("schema.unknown-key", f"unknown key `{dotted(p)}`", dotted(p),
                                     _where(locate, p, fallback), fix) for p, fix in nemo]
                continue
            if not section and name in ALGORITHM_SECTIONS:
                findings.append(Finding("schema.section", f"section `{name}` does not belong to algorithm "
                                        f"{data.get('algorithm')}", key, where,
                                        f"remove it, or set `algorithm: {name}` (or vlm_{name})"))
                continue
            near = suggest(str(name), keys_at(model, section))
            fix = f"did you mean `{dotted(section + (near,))}`?" if near else (
                f"remove it; keys allowed here: {', '.join(keys_at(model, section))}")
            findings.append(Finding("schema.unknown-key", f"unknown key `{key}`", key, where, fix))
        elif e["type"] == "missing":
            findings.append(Finding("schema.missing", f"missing required key `{key}`", key, where,
                                    "add it (the exemplar shows an example)"))
        elif e["type"] in ("literal_error", "choice"):
            choices = e["ctx"]["choices"] if e["type"] == "choice" else _choices(annotation_at(model, path))
            near = suggest(str(e["input"]), [str(c) for c in choices])
            shown = ", ".join(repr(c) for c in choices)
            fix = f"did you mean {near!r}?" if near else f"use one of {shown}"
            findings.append(Finding("schema.choice", f"`{key}`: {e['input']!r} is not one of {shown}", key, where, fix))
        else:
            msgs = " or ".join(dict.fromkeys(x["msg"].removeprefix("Value error, ") for x in errs))
            findings.append(Finding("schema.type", f"`{key}`: {msgs} (got {e['input']!r})", key, where,
                                    "fix the value; docs/config.md lists every key and its type"))
    return findings


def _nul_findings(data: Any, path: tuple, locate: Locate | None, fallback_where: str | None) -> list[Finding]:
    """Text holding a NUL byte: no file can be named by it (the OS refuses it deep in an open() call)."""
    if isinstance(data, str):
        if "\x00" not in data:
            return []
        key = ".".join(map(str, path))
        return [Finding("schema.type", f"`{key}` holds a NUL byte (\\0), which no path or name may contain", key,
                        _where(locate, path, fallback_where), f"remove the \\0 from `{key}`")]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [f for k, v in items for f in _nul_findings(v, (*path, k), locate, fallback_where)]


def _scalar_types(tp: Any) -> set:
    """The scalar types an annotation admits (through Annotated, Optional and unions); `object` for Any or a
    type the walk does not know."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _scalar_types(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_types(a) for a in typing.get_args(tp)))
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(tp)}
    if origin is not None:
        return {origin}
    return {tp} if isinstance(tp, type) else {object}


def number_not_bool(tp: Any) -> bool:
    """A key that takes a number and no boolean: pydantic would read `true` there as 1 (or 1.0)."""
    kinds = _scalar_types(tp)
    return bool(kinds & {int, float}) and not kinds & {bool, object}


def _child_type(tp: Any, key: Any) -> Any:
    """The annotation of entry `key` inside a value of type `tp` (a section, mapping, list or tuple), or None."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _child_type(typing.get_args(tp)[0], key)
    if origin in (typing.Union, types.UnionType):
        found = [c for c in (_child_type(a, key) for a in typing.get_args(tp)) if c is not None]
        return found[0] if found else None
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return _field_names(tp).get(key)
    if origin is dict:
        return typing.get_args(tp)[1]
    if origin in (list, set, frozenset):
        return typing.get_args(tp)[0]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[key] if isinstance(key, int) and key < len(args) else None
    return None


def _bool_findings(tp: Any, data: Any, path: tuple, locate: Locate | None, fallback_where: str | None) -> list[Finding]:
    """`true`/`false` where the schema wants a number: pydantic's lax mode would read them as 1 and 0, so
    `seq_logprob_error_threshold: true` became a threshold of 1.0 that masks every sequence."""
    if isinstance(data, bool):
        if not path or not number_not_bool(tp):
            return []
        key = dotted(path)
        return [Finding("schema.type", f"`{key}` is a number, not {str(data).lower()}", key,
                        _where(locate, path, fallback_where),
                        f"write a number for `{key}` (true and false are not read as 1 and 0)"
                        + (", or null to leave it unset" if type(None) in _scalar_types(tp) else ""))]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    out = []
    for k, v in items:
        child = _child_type(tp, k)
        if child is not None:
            out += _bool_findings(child, v, (*path, k), locate, fallback_where)
    return out


def schema_findings(data: Any, locate: Locate | None = None, fallback_where: str | None = None
                    ) -> tuple[RecipeBase | None, list[Finding]]:
    """Validate resolved recipe data; returns (model or None, findings). Never raises for bad input."""
    if not isinstance(data, dict):
        return None, [Finding("schema.type", "a recipe must be a mapping", None, fallback_where)]
    algo = data.get("algorithm")
    if algo is None:
        return None, [Finding("schema.missing", "missing required key `algorithm`", "algorithm", fallback_where,
                              f"add `algorithm: <one of {', '.join(ALGORITHMS)}>`")]
    if algo not in MODELS:
        near = suggest(str(algo), list(ALGORITHMS))
        return None, [Finding("schema.choice", f"`algorithm`: {algo!r} is not one of {', '.join(ALGORITHMS)}",
                              "algorithm", _where(locate, ("algorithm",), fallback_where),
                              f"did you mean {near!r}?" if near else f"use one of {', '.join(ALGORITHMS)}")]
    findings = []
    if "vision" in data and not is_vlm(algo):
        findings.append(Finding("schema.vision", f"`vision` is only for vlm_* algorithms, this recipe is {algo}",
                                "vision", _where(locate, ("vision",), fallback_where),
                                f"set `algorithm: vlm_{base_algorithm(algo)}` or remove `vision`"))
        data = {k: v for k, v in data.items() if k != "vision"}
    if "vision" not in data and is_vlm(algo):
        findings.append(Finding("schema.vision", f"{algo} needs a `vision:` section", "vision",
                                _where(locate, ("algorithm",), fallback_where),
                                "add `vision:` (max_image_pixels, max_images_per_sample, dedup_payloads)"))
        return None, findings
    findings += _nul_findings(data, (), locate, fallback_where)
    model = MODELS[algo]
    findings += _bool_findings(model, data, (), locate, fallback_where)
    try:
        cfg = model.model_validate(data)
    except ValidationError as err:
        return None, findings + _errors_to_findings(model, data, err, locate, fallback_where)
    return (None if findings else cfg), findings


def validate_config(data: Any, locate: Locate | None = None, fallback_where: str | None = None) -> RecipeBase:
    """Validated model of resolved recipe data; the first problem raises a one-line GymvError."""
    cfg, findings = schema_findings(data, locate, fallback_where)
    raise_first_error(findings)
    assert cfg is not None
    return cfg


def schema_has_key(data: dict, key: str) -> bool:
    """Whether the schema of `data`'s algorithm defines dotted `key` (entries of free mappings count)."""
    model = MODELS.get(data.get("algorithm")) if isinstance(data, dict) else None
    if model is None:
        return False
    path: list[str] = []
    for part in key.split("."):
        tp = annotation_at(model, tuple(path))
        if typing.get_origin(tp) is dict:
            return True  # free-form mapping (env.kwargs, smoke, mopd.teachers...) accepts any key
        path.append(part)
    return annotation_at(model, tuple(path)) is not None
