"""No import cycle among phalanx's modules, counting imports inside functions too: a deferred
import may buy start-up time, never hold a cycle open (issue 25, deliverable 5).

Edges: every ``import phalanx...`` / ``from phalanx... import`` anywhere in a module (top level,
functions, methods), except under ``if TYPE_CHECKING:`` (annotations only). ``from P import n``
points at the submodule P.n when there is one, else at P (a package's ``__init__`` counts as a
module: importing the package for its names depends on everything it imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "phalanx").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self, name: str, modules: dict[str, Path]) -> None:
        self.name, self.modules, self.edges = name, modules, set()

    def _module_of(self, dotted: str) -> str | None:
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _add(self, dotted: str, line: int) -> None:
        target = self._module_of(dotted)
        if target is not None and target != self.name:
            self.edges.add((target, line))

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        for child in node.orelse if name == "TYPE_CHECKING" else [*node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "phalanx":
                self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] != "phalanx":
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self._add(full if full in self.modules else module, node.lineno)


def import_graph() -> dict[str, set[tuple[str, int]]]:
    """module -> {(imported module, line)}."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        visitor = _Imports(name, modules)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        graph[name] = visitor.edges
    return graph


def cycles(graph: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for target, _ in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, set[tuple[str, int]]]) -> str:
    edges = [
        f"{a}:{line} -> {b}" for a in component for b, line in sorted(graph[a]) if b in component
    ]
    return "; ".join(edges)


def test_no_import_cycle_in_phalanx() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(c, graph) for c in found)


def test_the_check_finds_a_cycle() -> None:
    """The check can fail: two modules importing each other (one inside a function) is one."""
    graph = {
        "phalanx.a": {("phalanx.b", 3)},
        "phalanx.b": {("phalanx.c", 5)},
        "phalanx.c": {("phalanx.a", 9)},
        "phalanx.d": {("phalanx.a", 1)},
    }
    assert cycles(graph) == [["phalanx.a", "phalanx.b", "phalanx.c"]]
    source = "def f():\n    from phalanx.b import x\n"
    visitor = _Imports("phalanx.a", {"phalanx.a": Path(), "phalanx.b": Path()})
    visitor.visit(ast.parse(source))
    assert visitor.edges == {("phalanx.b", 2)}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import phalanx.b\n"
    visitor = _Imports("phalanx.a", {"phalanx.a": Path(), "phalanx.b": Path()})
    visitor.visit(ast.parse(typing_only))
    assert visitor.edges == set()


# Modules that `import phalanx` and the `phalanx` command do not load at start-up, and why an
# import of them waits until a function needs it (a deferred import of anything else buys
# nothing: it is loaded already).
LAZY = {
    "phalanx._dcp": "importing torch.distributed.checkpoint takes ~0.7 s; many runs never save",
    "phalanx.build": "assembles a whole run (data, model, Engine): only the verbs that run one",
    "phalanx.trainer": "the training loop: only `phalanx train` in a worker",
    "phalanx.dryrun": "only `phalanx train --dry-run`",
    "phalanx.data.pack": "only `phalanx data pack`",
    "phalanx.losses": "only runs built from a config",
    "phalanx.runtime.launch": "torch's elastic launcher: only launched runs",
    "phalanx.runtime.spawn": "rank processes: only benches and tests start them",
    "phalanx.pool_training": "only the WorkerPool training flow",
    "phalanx.memory.profile": "the per-layer profiler: only [memory], profile, plan, split = auto",
    "phalanx.memory.offload": "saved-tensor hooks and tiers: only a plan that offloads",
}


def _start_up_modules() -> set[str]:
    code = "import sys, phalanx, phalanx.cli; print(' '.join(m for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m for m in done.stdout.split() if m == "phalanx" or m.startswith("phalanx.")}


def _deferred_imports() -> list[tuple[str, int, str]]:
    """(module, line, imported module) of every phalanx import inside a function."""
    modules, found = _modules(), []
    for name, path in modules.items():
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                visitor = _Imports(name, modules)
                if isinstance(node, ast.Import | ast.ImportFrom):
                    visitor.visit(node)
                found += [(name, line, target) for target, line in visitor.edges]
    return found


def test_a_deferred_import_buys_start_up_time() -> None:
    """An import inside a function is of a module not loaded at start-up, with its reason in
    LAZY; and every module in LAZY is still not loaded at start-up."""
    loaded = _start_up_modules()
    assert not set(LAZY) & loaded, f"loaded at start-up, no longer lazy: {set(LAZY) & loaded}"
    pointless = [f"{m}:{line} -> {t}" for m, line, t in _deferred_imports() if t not in LAZY]
    assert not pointless, "deferred imports that buy nothing (import at the top): " + ", ".join(
        pointless
    )
