"""Every ``BATON_*`` environment variable is declared once, in ``baton.env`` (``pkg/env.py``): no
other product module spells a ``BATON_`` name in its code (docstrings and comments may name them)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from baton import env

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "services", "bench", "planner", "cli", "kernels", "pkg")
NAME = re.compile(r"BATON_[A-Z0-9_]+")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings (of the module, a class or a function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
        # An attribute's docstring: a bare string right after an assignment in a class or module.
        stmts = node.body if isinstance(node, (ast.Module, ast.ClassDef)) else []
        for a, b in zip(stmts, stmts[1:]):
            if isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr):
                if isinstance(b.value, ast.Constant):
                    out.add(id(b.value))
    return out


def test_no_module_but_baton_env_spells_a_baton_variable():
    found = []
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "pkg" / "env.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    found += [
                        f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in NAME.findall(node.value)
                    ]
    assert found == [], "read these through baton.env:\n" + "\n".join(found)


def test_each_variable_is_named_once_and_reads_its_default_when_unset():
    names = [v.name for v in env.ALL]
    assert len(names) == len(set(names)) and all(NAME.fullmatch(n) for n in names)
    assert env.BF16_GEMM.get({}) == "auto" and env.BF16_GEMM.get({"BATON_BF16_GEMM": ""}) == "auto"
    assert env.KERNEL_ISA.get({}) is None and env.KERNEL_ISA.get({"BATON_KERNEL_ISA": "avx2"}) == "avx2"
    assert env.REDIS_PASSWORD.file == "BATON_REDIS_PASSWORD_FILE"
    home = os.environ.get("HOME")
    try:  # the home of the moment, not of the import (a test, a pod's HOME)
        os.environ["HOME"] = "/elsewhere"
        assert env.CACHE_DIR.get({}) == "/elsewhere/.cache/baton"
    finally:
        if home is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = home
    assert env.api_keys({"BATON_API_KEY": " a, ,b "}) == ["a", "b"] and env.api_keys({}) == []
