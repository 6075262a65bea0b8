"""One default for each knob: the backends and workers take the recipe's sections (gymv.sections) and never
restate a section's default, so that two sources of truth cannot drift apart (a trainer's weight decay once
defaulted to 0.01 where the schema said 0.0).

The backends and workers (gymv/backends, gymv/cluster) are read as source, so that optional engines need not
import. Two shapes are refused:
- a mirror: a class whose fields copy two or more fields of one section, restating their defaults under their
  names or reading them (`default(Section, "key")`): such a class holds the section's values a second time, where
  it could hold the section itself;
- a repeat: a field or keyword default that restates the default of a section field of the same name, where
  that default is a choice (a number other than 0 and 1, a name other than "auto"); an off, unset or identity
  value (False, None, 0, 1, "auto", empty) says nothing two places could disagree on.
An interface that offers a knob as a keyword reads the section's default (`gymv.sections.default`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import BaseModel

from gymv import sections
from gymv.config.schema import MODELS

ENGINE = Path(sections.__file__).parent
LAYERS = ("backends", "cluster")  # between the recipe and the workers: they take the sections themselves
NEUTRAL = (None, False, True, "auto", "")
MIRROR_FIELDS = 2
# classes that share field names with a section without standing for it, and why
NOT_MIRRORS = {
    "TrainerMesh": "the sizes of a rank mesh (1: not split), built from training.parallel or the rank count",
    "SamplingParams": "the sampling of one call (a step's, validation's greedy one, a model-server request's "
                      "own): per-call values, starting from generation's defaults",
}


def section_models() -> set[type[BaseModel]]:
    """Every section model of every recipe, nested ones included."""
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        for field in model.model_fields.values():
            for t in (field.annotation, *getattr(field.annotation, "__args__", ())):
                for inner in (t, *getattr(t, "__args__", ())):
                    if isinstance(inner, type) and issubclass(inner, sections.Section) and inner not in seen:
                        seen.add(inner)
                        walk(inner)

    for recipe in MODELS.values():
        walk(recipe)
    return seen


def section_defaults() -> dict[str, list[tuple[str, object]]]:
    """field name -> [(section, default)] over every section field with a default."""
    out: dict[str, list[tuple[str, object]]] = {}
    for model in section_models():
        for name, field in model.model_fields.items():
            if not field.is_required() and not isinstance(field.default, BaseModel):
                out.setdefault(name, []).append((model.__name__, field.default))
    return out


def written_defaults(tree: ast.AST):
    """(class name or None, name, literal default, line) of every class field and keyword default in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            pairs = [(node.name, s.target.id, s.value) for s in node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = [(None, arg.arg, d) for arg, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)]
            pairs += [(None, arg.arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        else:
            continue
        for owner, name, value in pairs:
            try:
                literal = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue  # computed (e.g. read from the section): not a second default
            yield owner, name, literal, value.lineno


def section_reads(tree: ast.AST):
    """(class name, section name, key) of every class field whose default reads a section's default
    (`default(Section, "key")`): a field that copies that section field."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for s in node.body:
            v = s.value if isinstance(s, ast.AnnAssign) else None
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "default"
                    and len(v.args) == 2 and isinstance(v.args[0], ast.Name)
                    and isinstance(v.args[1], ast.Constant) and isinstance(v.args[1].value, str)):
                yield node.name, v.args[0].id, v.args[1].value


def engine_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ENGINE / layer).rglob("*.py"))


def shown(path: Path) -> str:
    return str(path.relative_to(ENGINE.parent)) if path.is_relative_to(ENGINE.parent) else str(path)


def is_neutral(value: object) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value in (0, 1)
    return value in NEUTRAL or value in ((), [], {})


def repeats(defaults: dict, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for _, name, value, line in written_defaults(ast.parse(path.read_text(), str(path))):
            same = [s for s, d in defaults.get(name, ()) if d == value and type(d) is type(value)]
            if same and not is_neutral(value):
                found.append(f"{shown(path)}:{line} {name}={value!r} restates {'/'.join(same)}.{name}")
    return found


def mirrors(defaults: dict, files: list[Path]) -> list[str]:
    found = []
    for path in files:
        by_class: dict[str, dict[str, set[str]]] = {}  # class -> section -> its fields the class restates
        tree = ast.parse(path.read_text(), str(path))
        for owner, name, value, _ in written_defaults(tree):
            if owner is None or owner in NOT_MIRRORS:
                continue
            for section, d in defaults.get(name, ()):
                if d == value and type(d) is type(value):
                    by_class.setdefault(owner, {}).setdefault(section, set()).add(name)
        for owner, section, key in section_reads(tree):
            if owner not in NOT_MIRRORS:
                by_class.setdefault(owner, {}).setdefault(section, set()).add(key)
        for owner, restated in by_class.items():
            for section, names in restated.items():
                if len(names) >= MIRROR_FIELDS:
                    found.append(f"{shown(path)}: {owner} restates {section}'s "
                                 f"{', '.join(sorted(names))}")
    return found


def test_no_backend_or_worker_restates_a_sections_default():
    assert repeats(section_defaults(), engine_files()) == []


def test_no_backend_or_worker_mirrors_a_section_in_a_class_of_its_own():
    assert mirrors(section_defaults(), engine_files()) == []


@pytest.mark.parametrize("source, finding", [
    ("from dataclasses import dataclass\n@dataclass\nclass TrainerConfig:\n    lr: float = 1e-6\n"
     "    eps: float = 1e-8\n    weight_decay: float = 0.01\n", "TrainerConfig restates TrainingSection's eps, lr"),
    ("def make(max_new_tokens: int = 64): ...\n", "max_new_tokens=64 restates GenerationSection.max_new_tokens"),
    ("from dataclasses import dataclass\nfrom gymv.sections import TeacherSection, default\n@dataclass\n"
     "class Spec:\n    alias: str\n    backend: str = default(TeacherSection, 'backend')\n"
     "    tp: int = default(TeacherSection, 'tensor_parallel_size')\n",
     "Spec restates TeacherSection's backend, tensor_parallel_size"),
])
def test_the_check_finds_a_mirror_and_a_repeated_default(tmp_path, source, finding):
    path = ENGINE / "backends" / "_probe_of_the_check.py"
    found = lambda files: repeats(section_defaults(), files) + mirrors(section_defaults(), files)  # noqa: E731
    path.write_text(source)
    try:
        assert any(finding in f for f in found([path])), found([path])
    finally:
        path.unlink()
