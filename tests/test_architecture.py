"""The import rules of docs/architecture.md, checked on the source with ``ast``.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``
(a lazy import is still a dependency, and hiding a cycle in a function is how the
tree lost its shape before).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "moepec"

APP = ("models", "train", "integrations", "cli", "bench", "__main__")
"""The app: built on the library, never imported by it."""

LAYERS = {
    # the library, bottom up; a module may import its own layer and the ones below
    "errors": 0, "keys": 0,
    "policy": 1,
    "state": 2,
    "store": 3,
    "recovery": 4,
    "manager": 5,
    "__init__": 6, "__main__": 10,
    # the app
    "models": 7, "train": 8, "integrations": 8, "bench": 9, "cli": 10,
}


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The moepec modules ``path`` imports (resolving ``from pkg import submodule``)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "moepec" or t.startswith("moepec."):
                while t not in known and "." in t:
                    t = t.rpartition(".")[0]
                if t != name:
                    out.add(t)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def layer_of(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(g.items()):
        for dep in sorted(deps):
            if dep == "moepec":  # the package root: the public API, imported by the app only
                if LAYERS[layer_of(mod)] < LAYERS["__init__"]:
                    bad.append(f"{mod} imports the public API package (moepec)")
                continue
            if LAYERS[layer_of(dep)] > LAYERS[layer_of(mod)]:
                bad.append(f"{mod} ({layer_of(mod)}) imports {dep} ({layer_of(dep)})")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    unknown = sorted({layer_of(m) for m in modules()} - set(LAYERS))
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


def test_the_library_never_imports_the_app():
    g = graph()
    bad = [f"{m} imports {d}" for m, deps in g.items() if layer_of(m) not in APP
           for d in deps if layer_of(d) in APP]
    assert not bad, "the library must not import models/train/cli/bench:\n" + "\n".join(bad)


def test_imports_only_go_down_the_layers():
    bad = layer_violations(graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("source, rule", [
    ("from moepec.train.config import TrainConfig\n", "layer"),
    ("def f():\n    from moepec.cli import main\n", "layer"),
    ("from moepec.store.persist import Persister\n", "cycle"),
])
def test_the_checks_catch_a_violating_import(tmp_path, source, rule):
    """The rules fail on a copy of the tree with one bad import added."""
    import shutil

    copy = tmp_path / "moepec"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "store" / "checksum.py"  # bottom of the store layer: imports nothing
    target.write_text(target.read_text() + "\n" + source)
    g = graph(copy)
    if rule == "layer":
        assert layer_violations(g)
    else:
        assert any("moepec.store.checksum" in c for c in cycles(g))
