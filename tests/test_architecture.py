"""The import graph runs one way: app -> runtime engine -> managers -> model_executor
-> models -> layers -> kernels, with mem beside the executor and a few leaf modules
(config, runtime's errors/sampling_params/model_config/token_roles) that import nothing above them.

Imports under TYPE_CHECKING count too: a type-only arrow pointing up is the first
step of a real import circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "bench", "runtime", "kernels", "config")

# Higher imports lower (or equal, within one room). Longest prefix wins.
RANKS: dict[str, float] = {
    "bench": 7.5,  # `sluice bench` is dispatched by app.cli; bench drives engines, never the app
    "app": 8,
    "runtime": 7,  # runtime/__init__, engine, engine_setup
    "runtime.disaggregation": 6.5,  # prefill/decode servers: drives the scheduler through its hooks
    "runtime.managers": 6,
    "runtime.model_executor": 5,
    "runtime.constrained": 4.5,  # grammar matchers: made by the scheduler, advanced by the worker
    "runtime.mem": 4,
    "runtime.models": 3,
    "runtime.layers": 2,
    "runtime.distributed": 7,  # the launcher starts ranks through engine_setup
    "runtime.distributed.parallel_state": 1.5,  # the collectives every layer calls
    "runtime.distributed.shm_comm": 1.4,  # their shared-memory form, over the kernels
    "kernels": 1,
    "runtime.errors": 0,
    "runtime.sampling_params": 0,
    "runtime.model_config": 0,
    "runtime.token_roles": 0,
    "config": 0,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> tuple[str, float]:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len)
    return best, RANKS[best]


def _imports(path: Path) -> set[str]:
    """Every sluice module `path` imports, at any depth of its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # `from pkg import name` names a module or an attribute: keep what is a module.
        graph[name] = {m if m in modules else m.rsplit(".", 1)[0] for m in _imports(path)} & modules.keys()
        graph[name].discard(name)
    return graph


def test_every_import_points_down_the_layers() -> None:
    upward = []
    for importer, targets in _graph().items():
        room, rank = _rank(importer)
        for target in targets:
            target_room, target_rank = _rank(target)
            if target_rank > rank:
                upward.append(f"{importer} ({room}) -> {target} ({target_room})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # A package's __init__ re-exporting its own modules lazily is not a circle between rooms.
    cycles = [c for c in cycles if not _init_only(c)]
    assert not cycles, f"import cycles: {cycles}"


def _init_only(component: list[str]) -> bool:
    """A cycle made only of a package and its own submodules (lazy __getattr__ re-exports)."""
    return any(all(m == pkg or m.startswith(pkg + ".") for m in component) and pkg in component for pkg in component)
