"""No import cycles inside gymv: the import graph is read from every module's AST (imports inside
functions count too: a lazy import is a dependency all the same), then searched for strongly connected
components, between modules and between gymv's top-level packages."""

from __future__ import annotations

import ast
from pathlib import Path

import gymv

ROOT = Path(gymv.__file__).resolve().parent

# Package cycles known today, each with what removing it takes; a new one fails, and so does a listed one
# that is gone (delete its entry then). None today.
KNOWN_PACKAGE_CYCLES: dict[frozenset, str] = {}


def module_names(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
        out[name] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports: `from pkg import sub` names the submodule, not `pkg`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(module)
    return {m for m in out if m in known and m != name}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_names(root, package)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def package_graph(graph: dict[str, set[str]], depth: int = 2) -> dict[str, set[str]]:
    top = lambda m: ".".join(m.split(".")[:depth])  # noqa: E731
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        out.setdefault(top(a), set()).update(top(b) for b in deps if top(b) != top(a))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_finder_reports_a_cycle_through_a_lazy_import_and_not_a_submodule_import(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from p.sub import leaf\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("from p import sub\n")  # the package's submodule, not its __init__
    (pkg / "a.py").write_text("import p.b\n")
    (pkg / "b.py").write_text("def f():\n    from p.a import g\n")
    graph = import_graph(pkg, "p")
    assert cycles(graph) == [["p.a", "p.b"]]
    assert cycles(package_graph(graph)) == [["p.a", "p.b"]]


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph(ROOT, "gymv")) == []


def test_no_new_cycle_between_gymv_packages_and_no_stale_entry_in_the_known_list():
    found = {frozenset(c) for c in cycles(package_graph(import_graph(ROOT, "gymv")))}
    assert found - set(KNOWN_PACKAGE_CYCLES) == set(), "a new package cycle"
    assert set(KNOWN_PACKAGE_CYCLES) - found == set(), "a known cycle is gone: delete its entry"


def test_the_cluster_layer_names_no_concrete_backend():
    """Workers build backends through gymv.backends.registry; a concrete one is named there alone."""
    from gymv.backends.registry import GENERATION_BACKENDS, TEACHER_BACKENDS, TRAINING_BACKENDS

    graph = import_graph(ROOT, "gymv")
    registries = (GENERATION_BACKENDS, TRAINING_BACKENDS, TEACHER_BACKENDS)
    concrete = {path.partition(":")[0] for r in registries for path in r.builtins.values()}
    concrete |= {"gymv.backends.training.torch_trainer", "gymv.backends.policy"}
    for name, deps in graph.items():
        if name.startswith("gymv.cluster"):
            assert not deps & concrete, f"{name} imports {sorted(deps & concrete)}"
