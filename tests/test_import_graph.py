"""The import graph of the `hybridmoe` package, built from the source with `ast`, has no cycle.

What counts as an edge A -> B (B a module of the package):
- `import B` and `from B import x` anywhere in A: at module level and inside functions alike. A
  function-level import only postpones the load; the two modules still depend on each other, and an
  interface that imports its implementations inside a function (the hand-written registries this
  test replaced) is exactly the coupling a cycle means. Imports under `if TYPE_CHECKING:` are
  excluded: they never run.
- `from P import name` where `P.name` is a submodule: an edge to that submodule (not to P). Any other
  name: an edge to P itself. Relative imports are resolved against A's package.
- A lazy registry target, a string constant "hybridmoe.x.y:attr" in A: an edge A -> hybridmoe.x.y,
  so a registry cannot hide a cycle either.
Not an edge: the implicit load of a module's parent packages (every package whose __init__ imports
one of its submodules would otherwise be a cycle, yet the interpreter always finishes a parent
package's __init__ before a child can import it back by name).

Run on another tree: IMPORT_GRAPH_ROOT=/path/to/checkout pytest tests/test_import_graph.py, or
`python tests/test_import_graph.py /path/to/checkout` to print the cycles.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections import deque
from pathlib import Path

import pytest

PACKAGE = "hybridmoe"
_TARGET = re.compile(rf"^({PACKAGE}(?:\.\w+)*):[\w.]+$")


def default_root() -> Path:
    """The checkout whose `hybridmoe/` is checked: $IMPORT_GRAPH_ROOT, or this repository."""
    env = os.environ.get("IMPORT_GRAPH_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[1]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package under `root`."""
    out: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of the tree except the bodies of `if TYPE_CHECKING:` (their `else:` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of `from <level dots><name> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a module of the package (None: external)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def module_imports(module: str, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports (see the module docstring for the rules)."""
    path = modules[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets.update(t for a in node.names if (t := _known(a.name, modules)))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            if not base or not base.startswith(PACKAGE):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _known(base, modules)
                if target:
                    targets.add(target)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if (m := _TARGET.match(node.value)) and (t := _known(m.group(1), modules)):
                targets.add(t)
    return targets


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports, for the package under `root`."""
    modules = module_files(root)
    return {m: module_imports(m, modules) for m in modules}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components (iterative), each sorted; only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1 or node in graph[node]:
                    out.append(sorted(comp))
    return sorted(out)


def _shortest_path(graph: dict[str, set[str]], src: str, dst: str, within: set[str]) -> list[str]:
    """Breadth-first shortest path src .. dst through nodes of `within` (both ends included)."""
    prev: dict[str, str | None] = {src: None}
    queue = deque([src])
    while queue:
        node = queue.popleft()
        if node == dst:
            path = [node]
            while (p := prev[path[-1]]) is not None:
                path.append(p)
            return path[::-1]
        for nxt in sorted(graph[node] & within):
            if nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{dst} unreachable from {src} inside its component")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles covering every edge that lies on one: for each edge u -> v inside a strongly connected
    component, u -> v -> (shortest way back) -> u. Each is a chain starting and ending at the same
    module, rotated to start at its smallest name; duplicates dropped."""
    seen: set[tuple[str, ...]] = set()
    cycles: list[list[str]] = []
    for comp in strongly_connected(graph):
        members = set(comp)
        for u in comp:
            for v in sorted(graph[u] & members):
                ring = [u] + (_shortest_path(graph, v, u, members)[:-1] if v != u else [])
                k = ring.index(min(ring))
                key = tuple(ring[k:] + ring[:k])
                if key not in seen:
                    seen.add(key)
                    cycles.append([*key, key[0]])
    return sorted(cycles, key=lambda c: (len(c), c))


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(c) for c in cycles)


# ---------------------------------------------------------------------------------------------- tests


def test_import_graph_has_no_cycle():
    root = default_root()
    graph = import_graph(root)
    assert len(graph) > 10, f"no {PACKAGE} package found under {root}"
    cycles = find_cycles(graph)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in {root / PACKAGE}:\n{format_cycles(cycles)}", pytrace=False)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_edges_follow_the_rules(tmp_path):
    """Each rule of the module docstring, on a small made-up package (so the checker itself can fail)."""
    _write_package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "from . import sub\nfrom .base import Thing\n",
        "a/base.py": (
            "from typing import TYPE_CHECKING\nimport os\n"
            "if TYPE_CHECKING:\n    from hybridmoe.a.impl import Impl\nelse:\n    import hybridmoe.b\n"
            "def load():\n    from ..a import impl\n    return impl\n"
        ),
        "a/impl.py": "from hybridmoe.a.base import Thing as T\n",
        "a/sub.py": "REG = {'x': 'hybridmoe.b.c:make'}\n",
        "b/__init__.py": "",
        "b/c.py": "from hybridmoe import a\n",
    })
    graph = import_graph(tmp_path)
    assert graph["hybridmoe.a"] == {"hybridmoe.a.sub", "hybridmoe.a.base"}
    # TYPE_CHECKING body skipped, its else branch kept; the function-level relative import counts
    assert graph["hybridmoe.a.base"] == {"hybridmoe.b", "hybridmoe.a.impl"}
    assert graph["hybridmoe.a.sub"] == {"hybridmoe.b.c"}  # a lazy registry target
    assert graph["hybridmoe.b.c"] == {"hybridmoe.a"}  # `from pkg import name`, name a package
    cycles = find_cycles(graph)
    assert ["hybridmoe.a.base", "hybridmoe.a.impl", "hybridmoe.a.base"] in cycles
    assert ["hybridmoe.a", "hybridmoe.a.sub", "hybridmoe.b.c", "hybridmoe.a"] in cycles
    assert all(c[0] == c[-1] for c in cycles)


def test_acyclic_package_passes(tmp_path):
    _write_package(tmp_path, {
        "__init__.py": "from hybridmoe import top\n",
        "top.py": "from hybridmoe.low import f\n",
        "low.py": "import torch\ndef f():\n    from typing import TYPE_CHECKING\n",
    })
    graph = import_graph(tmp_path)
    assert graph == {"hybridmoe": {"hybridmoe.top"}, "hybridmoe.top": {"hybridmoe.low"}, "hybridmoe.low": set()}
    assert find_cycles(graph) == []


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else default_root()
    found = find_cycles(import_graph(where))
    print(format_cycles(found) or "no cycle")
    sys.exit(1 if found else 0)
