"""A CPU kernel build is named by everything it is compiled from: a header the kernels include
changes the name as a source does, so an edited header is never served by a stale library. Nothing
is compiled here (the name is a hash of the files, flags and torch version)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from baton.kernels import cpu_ops, isa

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    """A copy of kernels/cpu that cpu_ops reads instead of the real one."""
    copy = tmp_path / "cpu"
    shutil.copytree(cpu_ops._SOURCE_DIR, copy)
    monkeypatch.setattr(cpu_ops, "_SOURCE_DIR", copy)
    return copy


def _names() -> set[str]:
    return {cpu_ops._spec(level).name for level in (isa.NATIVE, *(lv.name for lv in isa.LEVELS))}


def test_editing_a_header_renames_every_build(sources):
    before = _names()
    header = sources / "attention_common.h"
    header.write_text(header.read_text() + "\n// edited\n")
    after = _names()
    assert len(after) == len(before) and not before & after


def test_a_new_header_renames_the_build(sources):
    before = cpu_ops._spec(isa.NATIVE).name
    (sources / "extra.h").write_text("#pragma once\n")
    assert cpu_ops._spec(isa.NATIVE).name != before


def test_the_build_compiles_the_sources_only(sources):
    spec = cpu_ops._spec(isa.NATIVE)
    assert spec.sources and all(src.suffix == ".cpp" for src in spec.sources)


def test_every_included_header_is_hashed_and_packaged():
    hashed = {h.name for h in cpu_ops._headers()}
    included = {
        name
        for src in cpu_ops._SOURCE_DIR.glob("*.[ch]*")
        for name in re.findall(r'^#include "([^"]+)"', src.read_text(), re.MULTILINE)
    }
    assert included and included <= hashed
    package_data = re.search(r'^"baton.kernels" = \[(.*)\]$', (REPO / "pyproject.toml").read_text(), re.M)
    assert package_data and '"cpu/*.h"' in package_data[1]
