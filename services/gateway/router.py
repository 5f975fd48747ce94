"""Picks workers from the Redis registry and keeps one gRPC channel per worker address.

Today it picks the least loaded decode worker. The prefix-aware choice of a prefill worker (longest
cached prefix from the prefix index, weighed against load) belongs here too, beside ``pick_decode``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import grpc

from baton.common.index.registry import Role, WorkerInfo, WorkerRegistry
from baton.protos import baton_pb2_grpc

log = logging.getLogger(__name__)


class NoWorkerError(RuntimeError):
    """No live worker of the role needed is registered."""


class Router:
    """Worker choice for the gateway. Registry reads run in a thread (the client is synchronous), so
    the event loop never waits on Redis; the decode list is cached for ``refresh_s`` seconds."""

    def __init__(self, registry: WorkerRegistry, refresh_s: float = 0.5) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._decode: list[WorkerInfo] = []
        self._fetched_at = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._in_flight: Counter[str] = Counter()

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live workers from Redis now (no cache)."""
        return await asyncio.to_thread(self._registry.list, role)

    async def decode_workers(self) -> list[WorkerInfo]:
        """Live decode workers, at most ``refresh_s`` old."""
        async with self._refresh_lock:
            if time.monotonic() - self._fetched_at >= self._refresh_s:
                await self._refresh_decode()
        return self._decode

    async def _refresh_decode(self) -> None:
        self._fetched_at = time.monotonic()
        try:
            self._decode = await self.list_workers("decode")
        except Exception as e:  # noqa: BLE001 - a Redis blip: keep routing to the workers last seen
            log.warning("worker registry unreachable: %s", e)
            if not self._decode:
                raise NoWorkerError(f"the worker registry is unreachable: {e}") from None
            return
        await self._close_unused_channels({w.grpc_address for w in self._decode})

    async def pick_decode(self, exclude: Collection[str] = ()) -> WorkerInfo:
        """The least loaded decode worker whose address is not in ``exclude``."""
        candidates = [w for w in await self.decode_workers() if w.grpc_address not in exclude]
        if not candidates:
            raise NoWorkerError("no decode worker is available")
        return min(candidates, key=self._load_key)

    def _load_key(self, w: WorkerInfo) -> tuple[float, int, str]:
        # The reported load lags by up to a heartbeat; this gateway's own in-flight count does not,
        # so a burst spreads over the workers before their next beat.
        reported = w.load.get("num_running", 0.0) + w.load.get("num_waiting", 0.0)
        local = self._in_flight[w.grpc_address]
        return max(reported, local), local, w.id

    def forget(self, address: str) -> None:
        """Leave a worker that failed out of the choice until the next refresh."""
        self._decode = [w for w in self._decode if w.grpc_address != address]

    @contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Count a call to ``address`` as in flight while the block runs."""
        self._in_flight[address] += 1
        try:
            yield
        finally:
            self._in_flight[address] -= 1
            if not self._in_flight[address]:
                del self._in_flight[address]

    def decode_stub(self, address: str) -> baton_pb2_grpc.DecodeStub:
        return baton_pb2_grpc.DecodeStub(self._channel(address))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return channel

    async def _close_unused_channels(self, live: set[str]) -> None:
        for address in [a for a in self._channels if a not in live and not self._in_flight[a]]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
