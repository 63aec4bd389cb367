"""The import rules of docs/architecture.md, checked on the source with ``ast``.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``
(a lazy import is still a dependency, and hiding a cycle in a function is how the
tree lost its shape before).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from moepec.hooks import FaultHooks

ROOT = Path(__file__).resolve().parent.parent / "moepec"

APP = ("models", "train", "integrations", "plan", "cli", "bench", "__main__")
"""The app: built on the library, never imported by it."""

LAYERS = {
    # the library, bottom up; a module may import its own layer and the ones below
    "errors": 0, "keys": 0, "events": 0, "hooks": 0,
    "policy": 1,
    "state": 2,
    "store": 3,
    "ram": 4,
    "recovery": 5,
    "manager": 6, "flat": 6,
    "__init__": 7, "__main__": 11,
    # the app
    "models": 8, "train": 9, "integrations": 9, "plan": 9, "bench": 10, "cli": 11,
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
    assert not bad, "the library must not import models/train/plan/cli/bench:\n" + "\n".join(bad)


def test_imports_only_go_down_the_layers():
    bad = layer_violations(graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


# -- the app reaches the library through its public modules only ---------------------
PUBLIC_MODULES = frozenset({
    "moepec",                                   # the public API (moepec/__init__.py)
    "moepec.errors", "moepec.events", "moepec.hooks", "moepec.keys",  # the leaf modules
    "moepec.flat",                              # front end 2: what a framework door uses
    "moepec.state.experts", "moepec.state.rng",  # expert discovery; the process's RNG
    "moepec.store.storage",                     # Storage(path, options): open a root
    "moepec.recovery.offline", "moepec.recovery.offline_paths",  # the offline tools:
    "moepec.recovery.offline_flat", "moepec.recovery.offline_groups",  # inspect, verify,
    "moepec.recovery.flat_view", "moepec.recovery.records",  # export, recovery records
    "moepec.ram.jobs",                          # the shared-memory folder (moepec ram)
})
"""The library modules the app (models/, train/, integrations/, plan/, bench/, cli/) may
import (docs/architecture.md, "The public modules"), beside the packages below."""
PUBLIC_PACKAGES = ("moepec.policy",)
"""Library packages every module of which is public: policy/ is pure logic (selectors, PLT,
write plans, forecasts) that the planner models and a user's selection policy builds on."""


def public_violations(g: dict[str, set[str]]) -> list[str]:
    """Imports of the app that reach a library module outside the public ones."""
    def public(dep: str) -> bool:
        return dep in PUBLIC_MODULES or any(dep == p or dep.startswith(p + ".")
                                            for p in PUBLIC_PACKAGES)
    return [f"{mod} imports {dep}" for mod, deps in sorted(g.items())
            if layer_of(mod) in APP for dep in sorted(deps)
            if layer_of(dep) not in APP and not public(dep)]


def test_the_app_imports_only_public_modules():
    """The app is built on the library as a user's code is: through ``moepec`` and the
    public modules, never the engine's insides (the manager's modules, the persist worker,
    the RAM tier's slots, the stitcher)."""
    bad = public_violations(graph())
    assert not bad, ("import these through moepec or a public module (or make the module "
                     "public in docs/architecture.md and PUBLIC_MODULES):\n" + "\n".join(bad))


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


@pytest.mark.parametrize("source", [
    "from moepec.manager.manager import CheckpointManager\n",
    "def f():\n    from moepec.store.persist import Persister\n",
    "import moepec.ram.snapshot\n",
    "from moepec.recovery import stitch\n",
])
def test_the_public_module_rule_catches_an_internal_import(tmp_path, source):
    """The rule fails on a copy of the tree whose app imports one internal module."""
    import shutil

    copy = tmp_path / "moepec"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert not public_violations(graph(copy))
    target = copy / "cli" / "ram.py"
    target.write_text(target.read_text() + "\n" + source)
    assert any(v.startswith("moepec.cli.ram imports ") for v in public_violations(graph(copy)))


# -- sizes: a library module stays under 450 lines, a function under 50 --------------
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 50
NOT_LIBRARY = ("train", "plan", "cli", "bench", "models")
"""The app's packages, which the size rule leaves alone (integrations/ is held to it)."""


def size_violations(root: Path = ROOT) -> list[str]:
    """Library modules over MAX_MODULE_LINES lines and functions (methods, nested ones)
    over MAX_FUNCTION_LINES, counted from the ``def`` line to the last line of the body."""
    bad = []
    for name, path in modules(root).items():
        if layer_of(name) in NOT_LIBRARY:
            continue
        text = path.read_text()
        rel = path.relative_to(root.parent)
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            bad.append(f"{rel}: {n} lines (at most {MAX_MODULE_LINES}: split it by idea)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{rel}:{node.lineno}: {node.name}() is {length} lines (at "
                               f"most {MAX_FUNCTION_LINES}: split it into named steps)")
    return bad


def test_library_modules_and_functions_stay_small():
    """STYLE.md: a module does one thing; no library module over 450 lines, no function
    over 50 (moepec/ minus the app's train/, plan/, cli/, bench/, models/)."""
    bad = size_violations()
    assert not bad, "too large:\n" + "\n".join(bad)


def test_the_size_check_catches_a_large_module_and_function(tmp_path):
    tree = tmp_path / "moepec"
    for folder in ("store", "bench"):
        (tree / folder).mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tree / "store" / "big.py").write_text("def f():\n" + body + "\n" * MAX_MODULE_LINES)
    (tree / "store" / "fits.py").write_text("def f():\n" + body[:-len("    x49 = 49\n")])
    (tree / "bench" / "big.py").write_text("def f():\n" + body)  # the app: not checked
    bad = size_violations(tree)
    assert len(bad) == 2 and all("store/big.py" in b for b in bad), bad


# -- the app uses only the public contract ------------------------------------------
REPO = ROOT.parent
APP_SOURCES = ("moepec/train", "moepec/plan", "moepec/bench", "moepec/cli",
               "moepec/integrations", "benchmarks")
"""What is checked: the app's code (benchmarks included: they live in moepec/bench) and the
scripts under benchmarks/ (the Megatron upstream-test harness), all built on the library as
a user's code would be."""
INTERNALS = ("persister", "events", "snapshotter", "root_claim")
"""Attributes that were the app's way into the manager's insides (the persist worker, the
untyped event dicts, the copy worker, the lease); the public API has methods and typed
callbacks for them."""
SETTABLE = frozenset(f.name for f in dataclasses.fields(FaultHooks))
"""Public attributes of library objects documented as settable while the manager runs."""


def _library_privates(root: Path = ROOT) -> set[str]:
    """The ``_private`` attribute names the library defines (methods, fields, ``self._x``)."""
    names: set[str] = set()
    for name, path in modules(root).items():
        if layer_of(name) in APP:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _own_names(tree: ast.AST) -> set[str]:
    """Attribute names a file defines itself (its own classes' fields and methods)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.keyword) and node.arg:
            own.add(node.arg)  # argparse's set_defaults(_command=...) and the like
    return own


def _library_bindings(tree: ast.AST, known: set[str]) -> tuple[set[str], set[str]]:
    """Names bound to library modules, and names bound to library classes/functions,
    by the file's imports (any scope)."""
    mods: set[str] = set()
    objs: set[str] = set()

    def is_library(module: str) -> bool:
        return (module == "moepec" or module.startswith("moepec.")) and \
            layer_of(module) not in APP
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if is_library(a.name):
                    mods.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and is_library(node.module):
            for a in node.names:
                bound = a.asname or a.name
                (mods if f"{node.module}.{a.name}" in known else objs).add(bound)
    return mods, objs


def contract_violations(path: Path, privates: set[str], known: set[str]) -> list[str]:
    """Where ``path`` reaches past the library's public API: a library ``_private``
    attribute, ``.persister`` / ``.events``, an assignment to a library module's global
    (or ``setattr`` on one), or an assignment to an attribute of a library object built
    in the same function."""
    tree = ast.parse(path.read_text(), str(path))
    own = _own_names(tree)
    mods, objs = _library_bindings(tree, known)
    where = path.relative_to(path.parents[len(path.parts) - len(REPO.parts) - 1])
    bad: list[str] = []

    def say(node: ast.AST, what: str) -> None:
        bad.append(f"{where}:{node.lineno}: {what}: {ast.unparse(node)[:80]}")

    def root_name(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    built: set[str] = set()  # names assigned from a library constructor or function call
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and root_name(node.value.func) in objs | mods:
            built |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            is_self = isinstance(base, ast.Name) and base.id in ("self", "cls") or (
                isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                and base.func.id == "super")
            if node.attr in INTERNALS:
                say(node, f"reaches into .{node.attr}")
            elif node.attr in privates and node.attr not in own and not is_self:
                say(node, f"touches the library's private .{node.attr}")
            if isinstance(node.ctx, ast.Store) and not is_self:
                if isinstance(base, ast.Name) and base.id in mods or \
                        ast.unparse(base).startswith("moepec."):
                    say(node, "assigns a library module global")
                elif isinstance(base, ast.Name) and base.id in built \
                        and node.attr not in SETTABLE:
                    say(node, "assigns an attribute of a library object")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and root_name(node.args[0]) in mods:
            say(node, "sets a library module global")
    return sorted(bad, key=lambda line: int(line.split(":")[1]))


def app_sources(repo: Path = REPO) -> list[Path]:
    return [p for d in APP_SOURCES for p in sorted((repo / d).rglob("*.py"))]


def test_the_app_uses_only_the_public_api():
    """The trainer, CLI, benchmarks and integrations use nothing a user could not: no
    library ``_private`` attribute, no ``.persister`` / ``.events``, no patched module
    global (DESIGN.md, "Public API contract")."""
    privates, known = _library_privates(), set(modules())
    bad = [v for p in app_sources() for v in contract_violations(p, privates, known)]
    assert not bad, "the app reaches past the public API:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "def f(manager):\n    manager.persister.wait_idle()\n",
    "def f(manager):\n    return len(manager.events)\n",
    "def f(manager):\n    return manager._reporter\n",
    "from moepec.store import persist\npersist.fault_hook = print\n",
    "import moepec.store.storage\nmoepec.store.storage.no_gc = None\n",
    "from moepec.store import storage\nsetattr(storage, 'no_gc', None)\n",
    "from moepec import CheckpointManager\nm = CheckpointManager(1, 2, 3)\nm.k_persist = 2\n",
])
def test_the_contract_check_catches_a_reach_in(tmp_path, source):
    target = tmp_path / "moepec" / "bench" / "reach.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    assert contract_violations(target, _library_privates(), set(modules()))


def _moepec_classes(tp: object, out: set[type]) -> None:
    if isinstance(tp, type):
        out.add(tp)
    for arg in typing.get_args(tp):
        _moepec_classes(arg, out)


def test_every_type_in_the_managers_public_signatures_is_exported():
    """A user can name every type CheckpointManager's public methods take or return
    (``share(part: moepec.Part)``, ``restore() -> moepec.RestoreReport``, ...)."""
    import moepec
    from moepec.manager.manager import CheckpointManager
    missing = set()
    members = [(n, f) for n, f in inspect.getmembers(CheckpointManager, callable)]
    members += [(n, p.fget) for n, p in inspect.getmembers(
        CheckpointManager, lambda m: isinstance(m, property))]  # ledger -> PLTLedger, ...
    for name, fn in members:
        if name.startswith("_") and name != "__init__":
            continue
        for hint in typing.get_type_hints(fn).values():
            found: set[type] = set()
            _moepec_classes(hint, found)
            missing |= {f"{c.__qualname__} ({name})" for c in found
                        if c.__module__.startswith("moepec")
                        and getattr(moepec, c.__qualname__, None) is not c}
    assert not missing, f"export these from moepec: {sorted(missing)}"
