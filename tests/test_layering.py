"""The floors of the code base, enforced: imports point down, never up, and never in a circle.

The import graph is read from the source (AST), so imports inside functions
and under ``if TYPE_CHECKING`` count like any other: a deferred import that
points up is still an upward arrow. Every module must also import first in a
fresh interpreter, and ``import autopar`` must stay light.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autopar", "passes")

# floor -> the floors its modules may import (their own floor is always allowed)
FLOORS: dict[str, set[str]] = {
    "core": set(),
    "schedules": {"core"},
    "passes": {"core"},
    "planning": {"core", "schedules"},
    "compiler": {"core", "schedules", "passes", "planning"},
    "runtime": {"core", "schedules", "compiler"},
    "reference": {"core", "compiler"},
    "face": {"core", "schedules", "passes", "planning", "compiler", "runtime", "reference"},
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "passes":
        return "passes"
    if len(parts) > 1 and parts[1] in FLOORS:
        return parts[1]
    return "face"  # autopar/__init__.py, autopar/api.py, autopar/cli/


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that ``module`` imports anywhere in its source (names imported from a
    package that are themselves modules count as imports of those modules)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                continue
            # the longest known module that the name is or lies in
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in known:
                    if candidate != module:
                        out.add(candidate)
                    break
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert len(graph) >= 30, sorted(graph)
    # a known downward arrow is seen, including one written inside a function
    assert "autopar.core.tensor_placement" in graph["passes.sharding"]
    assert "autopar.compiler.program" in graph["autopar.runtime.engine.materialize"]


def test_no_import_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_import_points_down():
    bad = []
    for module, targets in sorted(import_graph().items()):
        here = floor_of(module)
        for target in sorted(targets):
            there = floor_of(target)
            if there != here and there not in FLOORS[here]:
                bad.append(f"{module} ({here}) imports {target} ({there})")
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_the_runtime_imports_no_pass():
    graph = import_graph()
    offenders = {m: sorted(t for t in ts if t.startswith("passes")) for m, ts in graph.items()
                 if floor_of(m) == "runtime"}
    assert not any(offenders.values()), offenders


# the runtime's rooms -> the rooms each may import (its own always); the engine is the top room, so
# no checkpoint, export or optimizer code reaches into the engine's internals
RUNTIME_ROOMS: dict[str, set[str]] = {
    "launch": set(),
    "tuning": {"launch"},
    "optim": set(),
    "checkpoint": {"optim"},
    "hf": {"checkpoint"},
    "weights": {"hf", "checkpoint"},
    "engine": {"launch", "optim", "checkpoint", "hf", "weights"},
}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["autopar", "runtime"] or len(parts) < 3:
        return None
    return parts[2]


def test_every_runtime_module_is_in_a_room():
    loose = [m for m in import_graph() if m.startswith("autopar.runtime.") and room_of(m) not in RUNTIME_ROOMS]
    assert not loose, f"runtime modules outside the rooms {sorted(RUNTIME_ROOMS)}: {sorted(loose)}"


def test_runtime_rooms_import_downward():
    bad = []
    for module, targets in sorted(import_graph().items()):
        here = room_of(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = room_of(target)
            if there is not None and there != here and there not in RUNTIME_ROOMS[here]:
                bad.append(f"{module} ({here}) imports {target} ({there})")
    assert not bad, "imports across the runtime's rooms against their order:\n" + "\n".join(bad)


def third_party_imports() -> list[str]:
    """What our modules import from outside the standard library and our packages: ``module`` for
    ``import module``, ``module:name`` for ``from module import name`` (which may load a lazy submodule)."""
    out = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = [f"{node.module}:{a.name}" for a in node.names]
            else:
                continue
            out.update(f for f in found if f.split(".")[0].split(":")[0] not in (*PACKAGES, *sys.stdlib_module_names))
    return sorted(out)


_IMPORT_EACH_FIRST = """
import gc, importlib, os, sys, traceback
ours, third_party = sys.argv[1].split(","), sys.argv[2].split(",")
for entry in third_party:  # loaded once, for every child; none of our modules is loaded before the forks
    module, _, name = entry.partition(":")
    try:
        getattr(importlib.import_module(module), name) if name else importlib.import_module(module)
    except Exception:  # an optional dependency that is missing: the child that needs it says so
        pass
gc.freeze()  # the children's collections leave the libraries' objects alone (no walk, no copy-on-write)
failed, running = [], {}
for module in ours:
    while len(running) >= (os.cpu_count() or 1):
        pid, status = os.wait()
        if status:
            failed.append(running[pid])
        del running[pid]
    pid = os.fork()
    if pid == 0:
        try:
            __import__(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    running[pid] = module
for pid, module in running.items():
    if os.waitpid(pid, 0)[1]:
        failed.append(module)
print("FAILED:" + ",".join(sorted(failed)))
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module is imported first in its own process (forked, a few at a time, from one that loaded
    only third-party libraries), so an import cycle hidden by the order tests import things fails here."""
    assert "torch" in third_party_imports()
    names = sorted(modules())
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, ",".join(names), ",".join(third_party_imports())],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = proc.stdout.strip().rsplit("FAILED:", 1)[-1]
    assert failed == "", f"these modules fail when imported first: {failed}\n{proc.stderr[-3000:]}"


def test_import_autopar_is_light():
    code = ("import sys, autopar; heavy = [m for m in ('sympy', 'autopar.planning.search.planner', 'autopar.compiler', "
            "'autopar.runtime.engine', 'passes.sharding', 'rich') if m in sys.modules]; print(','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"import autopar loaded {proc.stdout.strip()}"
    # the public names still resolve, lazily
    proc = subprocess.run([sys.executable, "-c", "import autopar; autopar.parallelize; autopar.plan; "
                           "autopar.spawn; autopar.ParallelConfig; print(sorted(autopar.__all__))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# the libraries' private names that module code reads by design: nn.Module's registries, a tensor's
# version counter, a HuggingFace model's weight initialiser
LIBRARY_PRIVATE = {"_parameters", "_buffers", "_modules", "_version", "_init_weights"}
# the rooms below the engine: they get narrow objects from it, never reach into its internals
BELOW_THE_ENGINE = ("checkpoint", "hf", "optim", "weights")


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: its functions, classes and their members, and the
    attributes it assigns on ``self``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def _rooted_at(node: ast.Attribute, name: str) -> bool:
    """Whether ``node`` is an attribute chain starting at the plain name ``name`` (``torch._C.x``)."""
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name) and value.id == name


def test_the_rooms_below_the_engine_read_no_private_attribute():
    """Checkpoint, export, optimizer and weight code read another object's state through its public
    names only (``x._name`` on ``self``, names the module defines itself, torch's own and the
    library names of ``LIBRARY_PRIVATE`` aside), so the engine can change its internals without breaking them."""
    bad = []
    for module, path in modules().items():
        if room_of(module) not in BELOW_THE_ENGINE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or node.attr in LIBRARY_PRIVATE or _rooted_at(node, "torch"):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not bad, "private attributes read across objects:\n" + "\n".join(bad)
