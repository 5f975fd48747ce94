"""Rooms of a readable size (issue 29): no product Python file over 500 lines but generated ones, no
function over 80 lines but Triton kernels and their launchers (a kernel is one body; its launcher is
shape checks). Parsed with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("pkg", "cli", "common", "kernels", "services", "bench", "planner")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _product_files() -> list[Path]:
    return [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py")) if "_pb2" not in p.name]


def _exempt(path: Path) -> bool:
    """Triton kernels and the launchers beside them."""
    return path.parent.name == "kernels" and path.name.startswith("triton_")


def test_no_product_file_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _product_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_function_is_over_80_lines_but_kernels():
    long = {}
    for path in _product_files():
        if _exempt(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}::{node.name}"] = n
    assert not long, long


def test_the_walk_sees_the_product():
    files = _product_files()
    assert len(files) > 100 and any(p.name == "dispatch.py" for p in files)
