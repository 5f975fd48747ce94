"""A group of ranks on torch.distributed: gloo on CPU, NCCL on GPU, the same calls either way.

The group is built from its own ``TCPStore`` and process-group object, not the global
``init_process_group``: a worker may hold other groups (the KV transport's pairs), and a group
that is an object can be closed and rebuilt. Pipeline parallelism builds several per rank (its
stage's tensor-parallel ranks; the ranks of its tensor-parallel index across the stages, which hand
activations on point to point: ``parallel.pipeline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupConfig:
    rank: int
    """This process's rank, 0 to ``size - 1``."""
    size: int
    """Ranks in the group."""
    host: str
    """Where rank 0's rendezvous store listens."""
    port: int
    """Its port (``free_port`` on rank 0)."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda:N`` (NCCL)."""
    timeout_s: float = 120.0
    """Longest a collective (or the rendezvous) waits for a peer before it fails."""
    name: str = "tp"
    """Key prefix in the store, so that groups sharing a store do not meet."""


class RankGroup:
    """The collectives tensor parallelism needs, on tensors of ``config.device``."""

    def __init__(self, config: GroupConfig):
        self.config = config
        self.rank = config.rank
        self.size = config.size
        self._pg: Any = None  # ProcessGroupGloo or ProcessGroupNCCL
        self._store: dist.Store | None = None  # must outlive the group

    def start(self) -> RankGroup:
        """Meet the other ranks (blocks until all of them have called ``start``)."""
        c = self.config
        timeout = timedelta(seconds=c.timeout_s)
        store = dist.TCPStore(c.host, c.port, c.size, is_master=c.rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(c.name, store)
        if c.device.startswith("cuda"):
            torch.cuda.set_device(c.device)  # NCCL's communicator binds to the current device
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, c.rank, c.size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, c.rank, c.size, timeout)
        self._store = store
        return self

    @property
    def pg(self) -> Any:
        if self._pg is None:
            raise RuntimeError("the rank group is not started")
        return self._pg

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype on each), in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return out

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Start sending ``t`` (contiguous, kept alive by the caller) to rank ``dst``; returns the
        work to ``wait()`` on."""
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> Any:
        """Start receiving into ``t`` from rank ``src``; returns the work to ``wait()`` on."""
        return self.pg.recv([t], src, tag)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.config.device))

    def close(self) -> None:
        self._pg = None
        self._store = None
