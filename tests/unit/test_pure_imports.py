"""The pure core imports with torch made unimportable (STYLE.md, habit 1).

Each check runs in a fresh interpreter where ``sys.modules["torch"] = None``, so any
``import torch`` along the import chain raises ImportError and the child exits non-zero.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PURE_MODULES = [
    "baton.bench.kv_step",
    "baton.bench.profile_plan",
    "baton.common.engine.hashing",
    "baton.common.engine.block_pool",
    "baton.common.engine.config",
    "baton.common.engine.kv_budget",
    "baton.common.engine.kv_cache_manager",
    "baton.common.engine.request",
    "baton.common.engine.sampling_params",
    "baton.common.engine.scheduler",
    "baton.common.engine.step_shapes",
    "baton.common.engine.structured_spec",
    "baton.common.index.auth",
    "baton.common.index.record_mac",
    "baton.common.index.registry",
    "baton.common.model.quant_names",
    "baton.common.net",
    "baton.kernels.kv_cache_dtypes",
    "baton.kernels.isa",
    "baton.bench.roofline",
    "baton.bench.autoscale_figures",
    "baton.bench.autoscale_emulated",
    "baton.planner.profile",
    "baton.planner.autoscale",
    "baton.planner.autoscale_io",
    "baton.planner.autoscale_sim",
    "baton.planner.capacity",
    "baton.planner.correction",
    "baton.planner.forecast",
    "baton.planner.cli",
    "baton.planner.baseline",
    "baton.planner.kustomize",
    "baton.planner.layout",
    "baton.planner.plan",
    "baton.planner.plan_cli",
    "baton.planner.served",
    "baton.planner.sim_engine",
    "baton.planner.sim_result",
    "baton.planner.simulate",
    "baton.planner.workload",
    "baton.cli",
    "baton.cli.main",
    "baton.common.engine.config_flags",
    "baton.services.cli_args",
    "baton.services.worker_cli",
    "baton.services.cluster_auth",
    "baton.services.gateway.app",
    "baton.services.up",
]

UNIT_DIR = Path(__file__).resolve().parent


def _run_blocked(body: str) -> subprocess.CompletedProcess:
    code = "import sys\nsys.modules['torch'] = None\n" + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_torch_block_is_effective():
    # Guards the other checks: with the block in place, importing torch itself must fail.
    proc = _run_blocked("import torch\n")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr or "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_without_torch(module):
    proc = _run_blocked(
        f"import importlib\nimportlib.import_module({module!r})\nassert sys.modules['torch'] is None\n"
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted(p.name for p in UNIT_DIR.glob("test_*.py")), ids=lambda name: name)
def test_unit_test_module_imports_without_torch(path):
    # The unit tests themselves must not need torch either. The checkout's root goes after
    # site-packages, as pytest's --import-mode=append puts it, so that `tests.unit.*` helpers import.
    proc = _run_blocked(
        f"sys.path.append({str(UNIT_DIR.parents[1])!r})\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(UNIT_DIR / path)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
    )
    assert proc.returncode == 0, proc.stderr
