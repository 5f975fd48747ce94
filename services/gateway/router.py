"""Picks workers from the Redis registry and keeps one gRPC channel per worker address.

A decode worker is chosen by the cost of serving the prompt there: the prompt tokens it would have
to compute (those past the longest prefix it caches, from the Redis prefix index) plus a charge per
request already queued or running on it. The prefix-aware choice of a prefill worker belongs here
too, beside ``pick_decode``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

import grpc

from baton.common.engine.hashing import BlockHasher
from baton.common.index.registry import Role, WorkerInfo, WorkerRegistry
from baton.protos import baton_pb2_grpc

log = logging.getLogger(__name__)


class NoWorkerError(RuntimeError):
    """No live worker of the role needed is registered."""


class Router:
    """Worker choice for the gateway. Registry reads run in a thread (the client is synchronous), so
    the event loop never waits on Redis; the decode list is cached for ``refresh_s`` seconds."""

    # What one queued or running request costs a worker, in prompt tokens to compute: about one
    # W2 prompt. A worker holding a 1k-token prefix wins until it has ~4 more requests than another.
    LOAD_COST_TOKENS = 256.0
    # A worker that failed mid-stream stays out of routing this long (the workers' registry TTL
    # is 6 s): a restarted worker registers a new address, so nothing live is kept out.
    FAILED_HOLD_S = 10.0
    # Keepalive on the channels to workers: a worker that stops answering (a hung process, a
    # dropped connection without a reset) fails its calls within ~4 s, also before a stream's first
    # token, when the gateway's progress deadline does not yet apply. The workers' servers allow
    # pings this often (``worker_base.GRPC_SERVER_OPTIONS``).
    CHANNEL_OPTIONS = (
        ("grpc.keepalive_time_ms", 2000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.http2.max_pings_without_data", 0),
    )

    def __init__(
        self,
        registry: WorkerRegistry,
        refresh_s: float = 0.5,
        prefix_index=None,
        block_size: int = 16,
    ) -> None:
        """``prefix_index`` (a ``PrefixIndex``) enables prefix-aware choice; ``block_size`` must be
        the workers' so that prompts hash to the blocks they publish."""
        self._registry = registry
        self._prefix_index = prefix_index
        self._hasher = BlockHasher(block_size)
        self._refresh_s = refresh_s
        self._decode: list[WorkerInfo] = []
        self._prefill: list[WorkerInfo] = []
        self._fetched_at = float("-inf")
        self._queued_tokens: Counter[str] = Counter()  # prompt tokens sent to a prefill worker
        self._refresh_lock = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._in_flight: Counter[str] = Counter()
        self._failed: dict[str, float] = {}  # address -> until when it is left out (monotonic)

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
            workers = await self.list_workers()
            self._decode = [w for w in workers if w.role == "decode"]
            self._prefill = [w for w in workers if w.role == "prefill"]
        except Exception as e:  # noqa: BLE001 - a Redis blip: keep routing to the workers last seen
            log.warning("worker registry unreachable: %s", e)
            if not self._decode:
                raise NoWorkerError(f"the worker registry is unreachable: {e}") from None
            return
        await self._close_unused_channels({w.grpc_address for w in self._decode})

    async def pick_decode(
        self, exclude: Collection[str] = (), prompt_token_ids: Sequence[int] = ()
    ) -> WorkerInfo:
        """The decode worker (address not in ``exclude``) where the prompt costs least: uncached
        prompt tokens plus ``LOAD_COST_TOKENS`` per request on it; ties go to the least loaded."""
        now = time.monotonic()
        self._failed = {a: until for a, until in self._failed.items() if until > now}
        candidates = [
            w
            for w in await self.decode_workers()
            if w.grpc_address not in exclude and w.grpc_address not in self._failed
        ]
        if not candidates:
            raise NoWorkerError("no decode worker is available")
        cached = await self._cached_tokens(prompt_token_ids)

        def cost(w: WorkerInfo) -> tuple[float, tuple[float, int, str]]:
            load = self._load_key(w)
            uncached = len(prompt_token_ids) - cached.get(w.id, 0)
            return uncached + self.LOAD_COST_TOKENS * load[0], load

        return min(candidates, key=cost)

    async def pick_prefill(self, prompt_token_ids: Sequence[int]) -> WorkerInfo | None:
        """The prefill worker where the prompt costs least: tokens it would compute (past the
        longest prefix it caches) plus the prompt tokens already queued on it. None when no prefill
        worker is up (the decode worker then prefills)."""
        await self.decode_workers()  # refreshes both lists
        if not self._prefill:
            return None
        cached = await self._cached_tokens(prompt_token_ids)

        def cost(w: WorkerInfo) -> tuple[float, str]:
            queued = max(w.load.get("queued_prefill_tokens", 0.0), self._queued_tokens[w.grpc_address])
            return len(prompt_token_ids) - cached.get(w.id, 0) + queued, w.id

        return min(self._prefill, key=cost)

    @contextmanager
    def track_prefill(self, address: str, num_tokens: int) -> Iterator[None]:
        """Count ``num_tokens`` as queued on a prefill worker while the block runs."""
        self._queued_tokens[address] += num_tokens
        try:
            yield
        finally:
            self._queued_tokens[address] -= num_tokens
            if self._queued_tokens[address] <= 0:
                del self._queued_tokens[address]

    async def _cached_tokens(self, prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """Worker id -> prompt tokens it caches (longest prefix), or {} without an index."""
        if self._prefix_index is None or len(prompt_token_ids) < self._hasher.block_size:
            return {}
        hashes = self._hasher.hash_blocks(prompt_token_ids)
        try:
            held = await asyncio.to_thread(self._prefix_index.longest_prefix, hashes)
        except Exception as e:  # noqa: BLE001 - a Redis blip costs a routing hint, not the request
            log.warning("prefix index unreachable: %s", e)
            return {}
        return {worker: blocks * self._hasher.block_size for worker, blocks in held.items()}

    def _load_key(self, w: WorkerInfo) -> tuple[float, int, str]:
        # The reported load lags by up to a heartbeat; this gateway's own in-flight count does not,
        # so a burst spreads over the workers before their next beat.
        reported = w.load.get("num_running", 0.0) + w.load.get("num_waiting", 0.0)
        local = self._in_flight[w.grpc_address]
        return max(reported, local), local, w.id

    def forget(self, address: str) -> None:
        """Leave a worker that failed out of the choice until the next refresh."""
        self._decode = [w for w in self._decode if w.grpc_address != address]

    def mark_failed(self, address: str) -> None:
        """Leave a decode worker whose stream failed mid-request out of the choice for
        ``FAILED_HOLD_S``, not only until the next refresh: its registry key outlives it by up to
        the heartbeat TTL, and the requests routed there meanwhile would each pay a failed call."""
        self._failed[address] = time.monotonic() + self.FAILED_HOLD_S
        self.forget(address)

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
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=list(self.CHANNEL_OPTIONS)
            )
        return channel

    async def _close_unused_channels(self, live: set[str]) -> None:
        for address in [a for a in self._channels if a not in live and not self._in_flight[a]]:
            await self._channels.pop(address).close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
