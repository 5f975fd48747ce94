"""KV cache transfer between workers: one interface (``base``), two transports (``ucx``, ``nccl``).

Importing this package pulls in neither torch nor a transport; the factories import the chosen
backend when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.common.transfer.base import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferDescriptor,
    TransferError,
    TransferHandle,
    TransferProgress,
    TransferStats,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVReceiver",
    "KVSender",
    "TransferConfig",
    "TransferDescriptor",
    "TransferError",
    "TransferHandle",
    "TransferProgress",
    "TransferStats",
    "make_receiver",
    "make_sender",
]


def make_receiver(config: TransferConfig, cache: torch.Tensor) -> KVReceiver:
    """A receiver for ``config.backend`` over ``cache``; call ``start()`` to open it."""
    if config.backend == "ucx":
        from baton.common.transfer.ucx import UcxReceiver

        return UcxReceiver(config, cache)
    from baton.common.transfer.nccl import NcclReceiver

    return NcclReceiver(config, cache)


def make_sender(config: TransferConfig, cache: torch.Tensor) -> KVSender:
    """A sender for ``config.backend`` from ``cache``; call ``connect(descriptor)`` to open it."""
    if config.backend == "ucx":
        from baton.common.transfer.ucx import UcxSender

        return UcxSender(config, cache)
    from baton.common.transfer.nccl import NcclSender

    return NcclSender(config, cache)
