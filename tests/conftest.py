"""Shared fixtures. Real weights load once per session: the model is small, loading is not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _checkout_root_after_site_packages() -> None:
    """The checkout's top-level folders are the ``baton.*`` packages (``kernels/`` is
    ``baton.kernels``). With the checkout's root first on ``sys.path``, as ``python -m pytest``,
    pytest's rootdir and xdist's workers put it, ``import kernels`` finds that folder instead of
    Hugging Face's ``kernels`` package, which transformers >= 5.25 requires and imports whenever it
    loads a model (the reference tests' ``ImportError: cannot import name 'CUDAProperties' from
    'kernels'``). The root stays on the path, for ``tests.*``, behind site-packages."""
    root = str(Path(__file__).resolve().parents[1])
    mine = [p for p in sys.path if os.path.abspath(p or os.curdir) == root]
    if mine:
        sys.path[:] = [p for p in sys.path if p not in mine] + [root]
    shadow = sys.modules.get("kernels")
    if shadow is not None and os.path.dirname(os.path.dirname(shadow.__file__ or "")) == root:
        del sys.modules["kernels"]


_checkout_root_after_site_packages()
# And in the processes the tests start (``python -c`` scripts, run from the checkout): the current
# directory stays off their path, as ``baton.common.launch`` keeps it off Baton's own.
os.environ["PYTHONSAFEPATH"] = "1"


def pytest_configure(config):
    """Under ``make test``'s two xdist workers each worker's own torch runs one thread: two workers
    of two OpenMP threads each on two cores spin against each other. The processes tests start
    (workers, clusters) choose their own threads as they would anywhere."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    from baton.common.model.source import default_model_path

    path = default_model_path()
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def llm_fp32():
    """The default model in fp32: the offline reference for engine, service and e2e tests."""
    from baton.common.llm import LLM

    return LLM(dtype="float32", kv_cache_gib=0.5)
