"""The schema: one closed model per algorithm; `vision:` exactly for the vlm_* variants."""

from __future__ import annotations

import pytest

from gymv.config import ALGORITHMS, MODELS, schema_findings, validate_config
from gymv.config.schema import GrpoRecipe, MopdRecipe, SftRecipe, VlmGrpoRecipe
from gymv.errors import GymvError

TEACHERS = {"teachers": {"t": {"path": "embedded:tiny-llava"}}}


def minimal(algo: str) -> dict:
    d: dict = {"algorithm": algo}
    if algo.endswith("mopd"):
        d["mopd"] = dict(TEACHERS)
    if algo.startswith("vlm_"):
        d["vision"] = {}
    return d


def test_algorithm_selects_the_model():
    assert type(validate_config({"algorithm": "sft"})) is SftRecipe
    assert type(validate_config({"algorithm": "grpo"})) is GrpoRecipe
    assert type(validate_config(minimal("mopd"))) is MopdRecipe
    assert type(validate_config(minimal("vlm_grpo"))) is VlmGrpoRecipe


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_algorithm_validates_with_only_its_required_keys(algo):
    assert validate_config(minimal(algo)).algorithm == algo


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_algorithm_rejects_an_unknown_key_with_its_dotted_path(algo):
    data = minimal(algo)
    data["training"] = {"parallel": {"tensr": 2}}
    _, findings = schema_findings(data)
    assert [f.message for f in findings] == ["unknown key `training.parallel.tensr`"]
    assert findings[0].fix == "did you mean `training.parallel.tensor`?"


@pytest.mark.parametrize("algo", ["vlm_sft", "vlm_grpo", "vlm_mopd"])
def test_vlm_variants_require_a_vision_section(algo):
    data = minimal(algo)
    del data["vision"]
    with pytest.raises(GymvError, match=f"{algo} needs a `vision:` section"):
        validate_config(data)


@pytest.mark.parametrize("algo", ["sft", "grpo", "mopd"])
def test_text_algorithms_forbid_a_vision_section(algo):
    data = minimal(algo)
    data["vision"] = {}
    with pytest.raises(GymvError, match="`vision` is only for vlm_\\* algorithms"):
        validate_config(data)


def test_another_algorithms_section_is_rejected_by_name():
    with pytest.raises(GymvError, match="section `sft` does not belong to algorithm grpo"):
        validate_config({"algorithm": "grpo", "sft": {}})


def test_mopd_needs_at_least_one_teacher():
    with pytest.raises(GymvError, match="mopd.teachers"):
        validate_config({"algorithm": "mopd", "mopd": {"teachers": {}}})


def test_an_unknown_key_inside_a_teacher_is_rejected_with_its_alias_in_the_path():
    _, f = schema_findings({"algorithm": "mopd", "mopd": {"teachers": {"big": {"path": "x", "placment": "separate"}}}})
    assert f[0].message == "unknown key `mopd.teachers.big.placment`" and "placement" in f[0].fix


def test_async_is_spelled_async_in_recipes_and_dumps():
    cfg = validate_config({"algorithm": "grpo", "grpo": {"async": {"enabled": True}, "importance_sampling": {"kind": "truncated"}}})
    assert cfg.grpo.async_.enabled and cfg.to_dict()["grpo"]["async"]["enabled"] is True


def test_an_unregistered_refit_transport_is_rejected():
    with pytest.raises(GymvError, match="unknown refit transport 'ncl'"):
        validate_config({"algorithm": "grpo", "refit": {"transport": "ncl"}})


def test_numbers_are_range_checked():
    with pytest.raises(GymvError, match="`grpo.prompts_per_step`.*greater than or equal to 1"):
        validate_config({"algorithm": "grpo", "grpo": {"prompts_per_step": 0}})


def test_data_train_accepts_a_path_or_a_list_of_paths():
    assert validate_config({"algorithm": "grpo", "data": {"train": ["a.jsonl", "b.jsonl"]}}).data.train == ["a.jsonl", "b.jsonl"]
    with pytest.raises(GymvError, match="`data.train`"):
        validate_config({"algorithm": "grpo", "data": {"train": 5}})


def test_every_section_forbids_extra_keys():
    def closed(model) -> bool:
        return model.model_config.get("extra") == "forbid"

    seen, todo = set(), list(MODELS.values())
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        assert closed(m), m.__name__
        for f in m.model_fields.values():
            for t in _models_in(f.annotation):
                todo.append(t)
    assert len(seen) > 15


def _models_in(tp):
    import typing

    from pydantic import BaseModel

    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models_in(a)]


def test_a_null_global_batch_is_one_optimizer_step_per_rollout_batch():
    cfg = validate_config({"algorithm": "grpo", "grpo": {"prompts_per_step": 4, "generations_per_prompt": 2}})
    assert cfg.training.global_batch_size == 8


@pytest.mark.parametrize("key, value", [("lr", float("inf")), ("lr", float("nan")), ("eps", float("inf")),
                                        ("max_grad_norm", float("inf"))])
def test_non_finite_numbers_are_refused_with_their_dotted_path(key, value):
    data = {"algorithm": "grpo", "training": {key: value}}
    _, findings = schema_findings(data)
    assert len(findings) == 1 and f"training.{key}" in findings[0].message + str(findings[0].where or "")
    assert "finite" in findings[0].message


def _numeric_paths(tp, path=()):
    """Every path in the schema where a number (and no boolean) goes: sections' fields, mapping entries (an
    alias `t`, a name `x`), the first item of a list or tuple."""
    import types
    import typing

    from pydantic import BaseModel

    from gymv.config.validate import number_not_bool

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        yield from _numeric_paths(args[0], path)
        return
    if origin in (typing.Union, types.UnionType):
        if number_not_bool(tp):
            yield path
            return
        for a in args:
            yield from _numeric_paths(a, path)
        return
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        for name, f in tp.model_fields.items():
            yield from _numeric_paths(f.annotation, (*path, f.alias or name))
    elif origin is dict:
        yield from _numeric_paths(args[1], (*path, "t" if path[-1] == "teachers" else "x"))
    elif origin in (list, tuple):
        yield from _numeric_paths(args[0], (*path, 0))
    elif number_not_bool(tp):
        yield path


def _with(data: dict, path: tuple, value) -> dict:
    import copy

    out = copy.deepcopy(data)
    node = out
    for i, p in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, list):
            node = node[p]
            continue
        if not isinstance(node.get(p), (dict, list)):
            node[p] = [0.5, 0.5] if isinstance(nxt, int) else {}
        node = node[p]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_a_boolean_is_refused_for_every_numeric_key(algo):
    """pydantic's lax mode reads `true` as 1 and 1.0: `seq_logprob_error_threshold: true` became 1.0, which
    masked every sequence; every numeric key of every section refuses a boolean, naming the key."""
    paths = sorted(set(_numeric_paths(MODELS[algo])), key=str)
    assert ("training", "lr") in paths and ("cluster", "max_restarts") in paths
    if not algo.endswith("sft"):
        assert (algo.removeprefix("vlm_"), "seq_logprob_error_threshold") in paths
    missed = []
    for path in paths:
        for value in (True, False):
            _, found = schema_findings(_with(minimal(algo), path, value))
            key = ".".join(map(str, path))
            if not any(f.key == key and f"is a number, not {str(value).lower()}" in f.message for f in found):
                missed.append((key, value))
    assert missed == []
