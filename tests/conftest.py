"""Shared fixtures. Real weights load once per session: the model is small, loading is not."""

from __future__ import annotations

import os

import pytest


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
