"""No import circles in apex_lite (DESIGN.md, "no import circles"; issue 51 removed the last one,
multi_tensor/_backend.py <-> _native.py).

The graph is read from the source with ``ast``, without importing anything: an edge for every
``import`` statement anywhere in a module (at its top, in a function or a class: an import
deferred into a function is still a circle, only a later one), except under ``if
TYPE_CHECKING:``, which never runs. ``from package import name`` is an edge to the module
``package.name`` when it is one, else to ``package``. The modules a build writes
(``apex_lite._C``, ``apex_lite._build_info``) are leaves. Importing a module imports its parent
packages first; that is not counted as an edge (every module would otherwise be in a circle
with its package's ``__init__``).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "apex_lite"
BUILT = {"apex_lite._C", "apex_lite._build_info"}


def modules_of(root: Path, package: str) -> Dict[str, Path]:
    """Dotted name -> source file, for every .py file of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: Dict[str, Path], built: Set[str]) -> Set[str]:
    """The modules of ``modules`` that the module ``name`` (source ``path``) imports; ``built``:
    the modules a build writes, leaves."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: Set[str] = set()

    def known(dotted: str):
        """``dotted`` or its longest prefix that is a module of the package."""
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) if parts else None

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known(alias.name)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif submodule in built:
                    continue
                else:
                    target = known(source)
                    if target:
                        found.add(target)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    found.discard(name)
    return found


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle (a list of modules, the first repeated at the end) per strongly connected
    component of ``graph`` with more than one module, found by Tarjan's algorithm."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[Set[str]] = []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        # A path back to the start, through the component, for the message.
        start = min(component)
        path, seen = [start], {start}
        while True:
            nxt = sorted(w for w in graph[path[-1]] if w in component)
            back = [w for w in nxt if w == start]
            if back and len(path) > 1:
                path.append(start)
                break
            step = [w for w in nxt if w not in seen] or nxt
            path.append(step[0])
            if step[0] in seen:
                break
            seen.add(step[0])
        found.append(path)
    return found


def import_graph(root: Path, package: str, built: Set[str]) -> Dict[str, Set[str]]:
    modules = modules_of(root, package)
    return {name: imports_of(name, path, modules, built) for name, path in modules.items()}


def test_apex_lite_has_no_import_circles():
    graph = import_graph(ROOT, PACKAGE, BUILT)
    assert "apex_lite.multi_tensor._backend" in graph and len(graph) > 50
    found = circles(graph)
    assert not found, "import circles in apex_lite (move what both sides need into a module " \
        "of its own that imports neither):\n" + "\n".join(" -> ".join(c) for c in found)


def _write(root: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, expected", [
    # The shape of the circle issue 51 removed: a top-level import one way, an import inside a
    # function the other way.
    ({"pkg/__init__.py": "", "pkg/mt/__init__.py": "from ._backend import ops_for\n",
      "pkg/mt/_backend.py": "def ops_for():\n    from . import _native\n    return _native\n",
      "pkg/mt/_native.py": "from ._backend import ops_for\n"},
     ["pkg.mt._backend", "pkg.mt._native", "pkg.mt._backend"]),
    # Absolute imports, `import a.b` and a three-module circle.
    ({"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "from pkg import c\n",
      "pkg/c.py": "class C:\n    def f(self):\n        from .a import x\n"},
     ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
    # An import under TYPE_CHECKING never runs: no circle.
    ({"pkg/__init__.py": "", "pkg/a.py": "from .b import B\n",
      "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"},
     None),
    # A module importing a name of its own package's __init__, and a built module: no circle.
    ({"pkg/__init__.py": "from . import a\n", "pkg/a.py": "from pkg import _C\nimport os\n"},
     None),
])
def test_the_finder_finds_circles(tmp_path, files, expected):
    _write(tmp_path, files)
    found = circles(import_graph(tmp_path, "pkg", {"pkg._C"}))
    assert found == ([expected] if expected else [])
