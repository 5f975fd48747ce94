"""``baton.common.launch``: the processes Baton starts do not import from the directory they were
started in, where a checkout's ``kernels/`` folder would shadow Hugging Face's ``kernels``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.launch import python_module


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is Python 3.11's")
def test_a_launched_module_is_not_looked_for_in_the_working_directory(tmp_path):
    (tmp_path / "only_here.py").write_text("print('imported from the working directory')\n")

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, env={})

    plain = run([sys.executable, "-m", "only_here"])  # what python -m alone does
    assert plain.returncode == 0 and "working directory" in plain.stdout, plain
    launched = run(python_module("only_here"))
    assert launched.returncode != 0 and "No module named only_here" in launched.stderr, launched
