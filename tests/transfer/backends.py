"""The KV transports the CPU tests run, named for what runs: Baton's ``"nccl"`` transport is
torch.distributed point-to-point, which over CPU caches is gloo, so its tests here are ``gloo``.
NCCL itself needs a GPU per rank: tests/gpu runs it, skipped without them."""

from __future__ import annotations

import pytest

CPU_BACKENDS = [pytest.param("ucx", id="ucx"), pytest.param("nccl", id="gloo")]
"""``TransferConfig.backend`` values, each with the test id of what it runs on a CPU host."""
