"""The import graph of Baton's product code: one way between files, folders and floors.

Every ``.py`` file under the trees below is parsed with ``ast`` (nothing is imported, so this
runs without torch). An import anywhere in a file counts, a lazy one inside a function too:
it is an edge all the same, only paid for later. Relative imports and ``baton.*`` names are
resolved to files through the ``package-dir`` mapping of ``pyproject.toml``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]

# pyproject.toml's [tool.setuptools.package-dir], for the trees this test reads.
TREES = {
    "common": "baton.common",
    "kernels": "baton.kernels",
    "services": "baton.services",
    "bench": "baton.bench",
    "planner": "baton.planner",
    "cli": "baton.cli",
}

# Floors: files under the first folder import nothing under the second. ``cli`` is the top floor:
# it assembles the subcommands that services, bench and planner register, and nothing imports it.
FORBIDDEN_FLOORS = [
    *((tree, "cli") for tree in ("common", "kernels", "services", "bench", "planner")),
    ("services", "bench"),  # bench starts services; the CLI above both registers each one's commands
    ("common", "services"),
    ("common", "bench"),
    ("kernels", "services"),
    ("kernels", "bench"),
    ("kernels", "common"),
    ("planner", "services"),
    ("planner", "bench"),
    ("common/model", "common/engine"),
    ("common/model", "common/parallel"),
    ("common/engine", "common/parallel"),
]

HEAVY_PACKAGES = ("torch", "triton")


class Import(NamedTuple):
    """One import statement's target, as seen from the importing file."""

    target: str  # the file it resolves to, relative to ROOT (a package is its __init__.py)
    names: tuple[str, ...]  # the names taken by ``from x import a, b``; () for ``import x``
    line: int
    top_level: bool  # at module level (runs when the module is imported)


def _module_index() -> dict[str, str]:
    """Dotted module name -> file path relative to ROOT."""
    index = {}
    for folder, package in TREES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            parts = list(rel.with_suffix("").parts[1:])
            if parts and parts[-1] == "__init__":
                parts.pop()
            index[".".join([package, *parts])] = rel.as_posix()
    return index


MODULES = _module_index()


def _package_of(rel: str) -> str:
    """The dotted package a file's relative imports start from."""
    path = Path(rel)
    folder, *rest = path.with_suffix("").parts
    return ".".join([TREES[folder], *rest[:-1]])


def _resolve(dotted: str) -> str | None:
    """The file of the longest known prefix of ``dotted``, or None outside Baton."""
    parts = dotted.split(".")
    while parts:
        found = MODULES.get(".".join(parts))
        if found:
            return found
        parts.pop()
    return None


def _absolute(node: ast.ImportFrom, rel: str) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(rel).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes that run on import (not inside a def, class bodies included)."""
    found: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.add(id(child))
            visit(child)

    visit(tree)
    return found


def parse_imports(rel: str) -> tuple[list[Import], set[str]]:
    """A file's imports of Baton files, and the heavy packages it imports at module level."""
    tree = ast.parse((ROOT / rel).read_text(), filename=rel)
    top = _top_level_nodes(tree)
    imports, heavy = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    imports.append(Import(target, (), node.lineno, id(node) in top))
                elif alias.name.split(".")[0] in HEAVY_PACKAGES and id(node) in top:
                    heavy.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, rel)
            if not node.level and module.split(".")[0] in HEAVY_PACKAGES and id(node) in top:
                heavy.add(module.split(".")[0])
            for alias in node.names:
                target = _resolve(f"{module}.{alias.name}") if MODULES.get(f"{module}.{alias.name}") else None
                target = target or _resolve(module)
                if target:
                    imports.append(Import(target, (alias.name,), node.lineno, id(node) in top))
    return imports, heavy


def _graph() -> dict[str, list[Import]]:
    return {rel: parse_imports(rel)[0] for rel in sorted(set(MODULES.values()))}


GRAPH = _graph()


def _folder(rel: str) -> str:
    return Path(rel).parent.as_posix()


def _under(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder + "/")


def _room(rel: str) -> str:
    """A file's node in the folder graph: its folder, or the file itself where it lies in a tree's
    root. A root (``common/``, ``services/``) is a namespace holding files of several floors
    (``common/llm.py`` above the engine, ``common/net.py`` below everything), not one room; its
    subfolders are the rooms, and the file graph covers the root's files one by one."""
    folder = _folder(rel)
    return rel if "/" not in folder else folder


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each as a cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return components


def _a_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One closed path through a component, for the failure message: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(edges.get(node, ()) & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in parents:
                parents[nxt] = node
                frontier.append(nxt)
    return component


def file_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for src, imports in GRAPH.items():
        for imp in imports:
            if imp.target != src:
                edges[src].add(imp.target)
    return edges


def folder_edges(top_only: bool) -> dict[str, set[str]]:
    """Room -> rooms it imports from (``_room``); ``top_only`` merges each tree into one node."""
    edges: dict[str, set[str]] = defaultdict(set)
    for src, imports in GRAPH.items():
        for imp in imports:
            a, b = _room(src), _room(imp.target)
            if top_only:
                a, b = a.split("/")[0], b.split("/")[0]
            if a != b:
                edges[a].add(b)
    return edges


def _show(components: list[list[str]], edges: dict[str, set[str]]) -> str:
    """One closed path per component, then every node caught in it."""
    return "\n".join(f"{' -> '.join(_a_cycle(c, edges))}   (all of: {', '.join(c)})" for c in components)


def test_every_tree_is_read():
    # Guards the checks below: the graph covers the product code and sees its imports.
    assert "common/engine/llm_engine.py" in GRAPH
    assert "planner/profile.py" in GRAPH
    assert "cli/main.py" in GRAPH
    assert any(imp.target == "common/engine/scheduler.py" for imp in GRAPH["common/engine/llm_engine.py"])


def test_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _a_cycle(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycle_between_files():
    edges = file_edges()
    cycles = _cycles(edges)
    assert not cycles, "import cycles between files:\n" + _show(cycles, edges)


def test_no_cycle_between_folders():
    edges = folder_edges(top_only=False)
    cycles = _cycles(edges)
    assert not cycles, "import cycles between folders:\n" + _show(cycles, edges)


def test_no_cycle_between_trees():
    edges = folder_edges(top_only=True)
    cycles = _cycles(edges)
    assert not cycles, "import cycles between common, kernels, services, bench, planner, cli:\n" + _show(
        cycles, edges
    )


def test_no_private_name_taken_from_another_module():
    reaches = []
    for src, imports in GRAPH.items():
        for imp in imports:
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            # A package's private submodule (``from . import _codec``) is its own business.
            private = [n for n in private if not _is_sibling_module(src, imp.target, n)]
            if private and imp.target != src:
                reaches.append(f"{src}:{imp.line} takes {', '.join(private)} from {imp.target}")
    assert not reaches, "private names imported across modules:\n" + "\n".join(reaches)


def _is_sibling_module(src: str, target: str, name: str) -> bool:
    package_dir = _folder(target) if target.endswith("__init__.py") else None
    return package_dir == _folder(src) and (ROOT / package_dir / f"{name}.py").exists()


def test_floors():
    upward = []
    for src, imports in GRAPH.items():
        for imp in imports:
            for low, high in FORBIDDEN_FLOORS:
                if _under(src, low) and _under(imp.target, high):
                    upward.append(f"{src}:{imp.line} imports {imp.target} ({low} is below {high})")
    assert not upward, "imports upward:\n" + "\n".join(upward)


def _heavy_modules() -> set[str]:
    """Files that pull in torch or triton when imported (module-level imports, transitively)."""
    heavy = {rel for rel in GRAPH if parse_imports(rel)[1]}
    changed = True
    while changed:
        changed = False
        for rel, imports in GRAPH.items():
            if rel not in heavy and any(imp.top_level and imp.target in heavy for imp in imports):
                heavy.add(rel)
                changed = True
    return heavy


def test_planner_takes_no_torch_module_from_the_engine():
    heavy = _heavy_modules()
    assert "common/engine/llm_engine.py" in heavy  # the check below can fail
    reaches = [
        f"{src}:{imp.line} imports {imp.target}"
        for src, imports in GRAPH.items()
        if _under(src, "planner")
        for imp in imports
        if _under(imp.target, "common/engine") and imp.target in heavy
    ]
    assert not reaches, "planner imports torch modules of the engine:\n" + "\n".join(reaches)
