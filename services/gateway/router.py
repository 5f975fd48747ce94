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
from collections import Counter, deque
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import get_args

import grpc
from grpc_health.v1 import health_pb2_grpc

from baton.common.engine.hashing import BlockHasher
from baton.common.index.outage import OutageLog
from baton.common.index.registry import Role, WorkerInfo, WorkerRegistry
from baton.protos import baton_pb2_grpc
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS
from baton.services.grpc_tls import channel as tls_channel

log = logging.getLogger(__name__)


class NoWorkerError(RuntimeError):
    """No live worker of the role needed is registered."""


@dataclass(frozen=True)
class PrefillChoice:
    """The prefill worker ``Router.pick_prefill`` chose and the prompt tokens it should compute
    there (those past the prefix it caches, as the prefix index says)."""

    worker: WorkerInfo
    uncached_tokens: int


class Router:
    """Worker choice for the gateway.

    Redis can go away; routing goes on. Requests are routed on the last worker list read from the
    registry: a list older than ``refresh_s`` starts a read in the background and requests go on
    with the list they have, so no request waits on a registry read unless there is no list at all
    (start-up; then at most ``first_read_timeout_s``, and 503 if the registry cannot be read). While
    the registry cannot be read, workers are weighed by this gateway's own in-flight counts (their
    reported loads are stale) and the prefix index is left alone: a lookup that fails or takes more
    than ``lookup_timeout_s`` costs its request that routing hint only, and the next ones skip the
    index until a registry read succeeds again. Redis calls run on a small pool of their own
    threads, so a Redis that hangs cannot starve the event loop's default executor (tokenizing).
    """

    # What one queued or running request costs a worker, in prompt tokens to compute: about one
    # W2 prompt. A worker holding a 1k-token prefix wins until it has ~4 more requests than another.
    LOAD_COST_TOKENS = 256.0
    # A worker that failed mid-stream stays out of routing this long (the workers' registry TTL
    # is 6 s): a restarted worker registers a new address, so nothing live is kept out.
    FAILED_HOLD_S = 10.0
    # A registry read that finds no worker of a role, where the last one found some, is a Redis that
    # restarted empty (or was flushed), not every worker of the role leaving at once: the workers
    # register again at their next heartbeat (every TTL / 3 = 2 s by default), each on its own
    # clock, so the first read after the restart may find the prefill worker back and no decode
    # worker yet (CI stop 46: a 503 for every request of those two seconds). Until this long has
    # passed, routing goes on with that role's workers last seen beside those back already. A worker
    # that really left refuses new work, and the request goes to another (or answers 503 as it
    # would have).
    REGISTRY_RESET_HOLD_S = 6.0
    # A worker list whose latest read started this long ago (a gateway without traffic reads
    # nothing) is read again before a request routes on it, not beside: the workers' heartbeat
    # (TTL / 3 = 2 s by default) is as long as a list stays current. While traffic flows, lists
    # are at most ``refresh_s`` old and no request waits.
    IDLE_READ_S = 2.0
    # Keepalive on the channels to workers: a worker that stops answering (a hung process, a
    # dropped connection without a reset) fails its calls within ~4 s, also before a stream's first
    # token, when the gateway's progress deadline does not yet apply. The workers' servers allow
    # pings this often (``worker_base.GRPC_SERVER_OPTIONS``).
    CHANNEL_OPTIONS = (
        ("grpc.keepalive_time_ms", 2000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.http2.ping_timeout_ms", 2000),  # grpcio 1.85 enforces the ack wait only with this
        ("grpc.http2.max_pings_without_data", 0),
        # Each channel its own connections: gRPC shares them between channels to one address by
        # default, and a new channel (``redial``) would inherit the old one's reconnect backoff.
        ("grpc.use_local_subchannel_pool", 1),
    )

    def __init__(
        self,
        registry: WorkerRegistry,
        refresh_s: float = 0.5,
        prefix_index=None,
        block_size: int = 16,
        first_read_timeout_s: float = 2.0,
        lookup_timeout_s: float = 0.5,
        tls: GrpcTLS = PLAINTEXT,
    ) -> None:
        """``prefix_index`` (a ``PrefixIndex``) enables prefix-aware choice; ``block_size`` must be
        the workers' so that prompts hash to the blocks they publish. ``first_read_timeout_s``
        bounds a request's wait for a registry read when there is no worker list yet;
        ``lookup_timeout_s`` bounds a prefix-index lookup in a request's path. ``tls``: the
        gateway's TLS identity towards the workers (``services/grpc_tls.py``)."""
        self._tls = tls
        self._registry = registry
        self._prefix_index = prefix_index
        self._hasher = BlockHasher(block_size)
        self._refresh_s = refresh_s
        self._first_read_timeout_s = first_read_timeout_s
        self._lookup_timeout_s = lookup_timeout_s
        self._decode: list[WorkerInfo] = []
        self._prefill: list[WorkerInfo] = []
        self._fetched_at = float("-inf")
        self._queued_tokens: Counter[str] = Counter()  # prompt tokens sent to a prefill worker
        # address -> (when, tokens) of this gateway's prefills that ended there since the registry
        # read its lists came from started: that read's load figures may still count them.
        self._prefilled: dict[str, deque[tuple[float, int]]] = {}
        self._refresh: asyncio.Task | None = None
        self._registry_error: Exception | None = None
        """Why the latest registry read failed; None once one succeeds."""
        self._read_ok_at = float("-inf")  # when the latest successful registry read started
        self._lookup_failed_at = float("-inf")
        self._registry_outage = OutageLog(log, "worker registry (gateway)")
        self._index_outage = OutageLog(log, "prefix index (gateway)")
        self._redis_pool: ThreadPoolExecutor | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._redialed: list[tuple[str, grpc.aio.Channel]] = []  # replaced, closed once unused
        self._in_flight: Counter[str] = Counter()
        self._failed: dict[str, float] = {}  # address -> until when it is left out (monotonic)
        self._last_read: list[WorkerInfo] = []  # what the latest successful registry read found
        # role -> (until when, the workers of that role last seen) after a read found none of it
        self._held: dict[str, tuple[float, list[WorkerInfo]]] = {}

    async def _redis(self, fn, *args):
        """``fn(*args)`` (a blocking Redis call) on the router's own threads (a few: each call is
        bounded by the client's timeouts, and lookups are skipped while Redis is away)."""
        if self._redis_pool is None:
            self._redis_pool = ThreadPoolExecutor(4, thread_name_prefix="baton-redis")
        return await asyncio.get_running_loop().run_in_executor(self._redis_pool, fn, *args)

    async def list_workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live workers from Redis now (no cache; bounded by the client's timeouts)."""
        return await self._redis(self._registry.list, role)

    @property
    def registry_reachable(self) -> bool:
        """Whether the latest registry read succeeded (the worker list and loads are current)."""
        return self._registry_error is None

    @property
    def prefill_workers(self) -> list[WorkerInfo]:
        """The prefill workers of the last registry read (what ``pick_prefill`` chooses from)."""
        return self._prefill

    async def decode_workers(self) -> list[WorkerInfo]:
        """The decode workers of the last registry read, refreshed in the background once older
        than ``refresh_s``; waits for the read while there is none to route on (at most
        ``first_read_timeout_s``), and after the gateway sat idle past ``IDLE_READ_S`` with the
        registry reachable, when the list may name workers gone since and lack those that came (at
        most ``lookup_timeout_s``: a Redis that went away meanwhile costs what a lookup would)."""
        idle = time.monotonic() - self._fetched_at >= max(self._refresh_s, self.IDLE_READ_S)
        refresh = self._refresh_if_stale()
        if not refresh.done():
            if not self._decode:
                await asyncio.wait({refresh}, timeout=self._first_read_timeout_s)
            elif idle and self._registry_error is None:
                await asyncio.wait({refresh}, timeout=self._lookup_timeout_s)
        if not self._decode and self._registry_error is not None:
            raise NoWorkerError(f"the worker registry is unreachable: {self._registry_error}")
        return self._decode

    def _refresh_if_stale(self) -> asyncio.Task:
        """The registry read in flight, starting one if the last is ``refresh_s`` old."""
        task = self._read_in_flight()
        if task is None and time.monotonic() - self._fetched_at >= self._refresh_s:
            task = self._start_read()
        task = task or self._refresh  # the last read, ended (or another event loop's)
        assert task is not None
        return task

    def _read_in_flight(self) -> asyncio.Task | None:
        """The registry read running on this event loop, if any."""
        task = self._refresh
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            return None
        return task

    def _start_read(self) -> asyncio.Task:
        self._refresh = asyncio.get_running_loop().create_task(self._refresh_decode())
        return self._refresh

    async def _read_since(self, t: float) -> None:
        """Until a registry read that started at ``t`` or later has ended (the one in flight, or one
        started for it), at most ``first_read_timeout_s``."""
        deadline = time.monotonic() + self._first_read_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            task = self._read_in_flight()
            if task is None:
                if self._fetched_at >= t:
                    return
                task = self._start_read()
            await asyncio.wait({task}, timeout=left)

    async def _refresh_decode(self) -> None:
        started = self._fetched_at = time.monotonic()
        try:
            workers = await self.list_workers()
        except Exception as e:  # noqa: BLE001 - Redis away: keep routing to the workers last seen
            self._registry_error = e
            self._registry_outage.failed(e)
            return
        self._registry_error, self._read_ok_at = None, started
        self._registry_outage.ok()
        workers = self._through_a_reset(workers, started)
        self._decode = [w for w in workers if w.role == "decode"]
        self._prefill = [w for w in workers if w.role == "prefill"]
        await self._close_unused_channels({w.grpc_address for w in self._decode})

    def _through_a_reset(self, workers: list[WorkerInfo], now: float) -> list[WorkerInfo]:
        """``workers`` as read and, for a role that a read found none of where the read before
        found some (a Redis restarted empty), that role's workers last seen and not back yet,
        within ``REGISTRY_RESET_HOLD_S`` of that read."""
        for role in get_args(Role):
            before = [w for w in self._last_read if w.role == role]
            until, _ = self._held.get(role, (float("-inf"), []))
            if before and now >= until and not any(w.role == role for w in workers):
                self._held[role] = (now + self.REGISTRY_RESET_HOLD_S, before)
                log.warning(
                    "the worker registry lists no %s worker (a Redis restarted empty?): routing on "
                    "the %d last seen for up to %.0f s while they register again",
                    role,
                    len(before),
                    self.REGISTRY_RESET_HOLD_S,
                )
        self._last_read = workers
        self._held = {role: held for role, held in self._held.items() if now < held[0]}
        back = {w.id for w in workers}
        kept = [w for _, held in self._held.values() for w in held if w.id not in back]
        return [*workers, *kept]

    async def pick_decode(
        self, exclude: Collection[str] = (), prompt_token_ids: Sequence[int] = ()
    ) -> WorkerInfo:
        """The decode worker (address not in ``exclude``) where the prompt costs least: uncached
        prompt tokens plus ``LOAD_COST_TOKENS`` per request on it; ties go to the least loaded.
        Workers that failed a stream lately (``mark_failed``) are chosen only when no other is left:
        a worker that lost one stream (a starved keepalive, a stall) may serve the next, and a
        refusal would cost the request where trying costs at most a failed call."""
        now = time.monotonic()
        self._failed = {a: until for a, until in self._failed.items() if until > now}
        workers = [w for w in await self.decode_workers() if w.grpc_address not in exclude]
        if not workers and exclude:
            # Every worker of this list failed the request: a read since may know another (one
            # that replaced them) before the request is refused.
            await self._read_since(now)
            workers = [w for w in self._decode if w.grpc_address not in exclude]
        candidates = [w for w in workers if w.grpc_address not in self._failed] or workers
        if not candidates:
            raise NoWorkerError("no decode worker is available")
        cached = await self._cached_tokens(prompt_token_ids)

        def cost(w: WorkerInfo) -> tuple[float, tuple[float, int, str]]:
            load = self._load_key(w)
            uncached = len(prompt_token_ids) - cached.get(w.id, 0)
            return uncached + self.LOAD_COST_TOKENS * load[0], load

        return min(candidates, key=cost)

    async def pick_prefill(self, prompt_token_ids: Sequence[int]) -> PrefillChoice | None:
        """The prefill worker where the prompt costs least: tokens it would compute (past the
        longest prefix it caches) plus the prompt tokens already queued on it. None when no prefill
        worker is up (the decode worker then prefills).

        A worker's published queue may be a heartbeat old: the prompts this gateway saw finish
        there since the registry read that carried it are taken off it, so that the next turn of a
        conversation goes to the worker caching its prefix, not away from it because the worker
        still reported the turn before as queued."""
        try:
            await self.decode_workers()  # refreshes both lists
        except NoWorkerError:  # nothing read yet: ``pick_decode`` says so, in the API's shape
            return None
        candidates = self._prefill  # this list: a registry read during the lookup replaces it
        if not candidates:
            return None
        cached = await self._cached_tokens(prompt_token_ids)

        def cost(w: WorkerInfo) -> tuple[float, str]:
            address = w.grpc_address
            reported = self._reported(w, "queued_prefill_tokens") - self._finished_since_read(address)
            queued = max(reported, self._queued_tokens[address], 0)
            return len(prompt_token_ids) - cached.get(w.id, 0) + queued, w.id

        best = min(candidates, key=cost)
        return PrefillChoice(best, len(prompt_token_ids) - cached.get(best.id, 0))

    @contextmanager
    def track_prefill(self, address: str, num_tokens: int) -> Iterator[None]:
        """Count ``num_tokens`` (``PrefillChoice.uncached_tokens``) as queued on a prefill worker
        while the block runs (until the prompt's first token); then as finished there, for the
        registry's figures that may still count them."""
        self._queued_tokens[address] += num_tokens
        try:
            yield
        finally:
            self._queued_tokens[address] -= num_tokens
            if self._queued_tokens[address] <= 0:
                del self._queued_tokens[address]
            self._prefilled.setdefault(address, deque(maxlen=4096)).append((time.monotonic(), num_tokens))
            self._finished_since_read(address)  # drops what the lists' read already saw

    def _finished_since_read(self, address: str) -> int:
        """Prompt tokens this gateway's prefills at ``address`` ended with since the registry read
        that the worker lists come from started."""
        done = self._prefilled.get(address)
        if done is None:
            return 0
        while done and done[0][0] < self._read_ok_at:
            done.popleft()
        if not done:
            del self._prefilled[address]
            return 0
        return sum(n for _, n in done)

    async def _cached_tokens(self, prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """Worker id -> prompt tokens it caches (longest prefix), or {} without an index, or while
        Redis is away (bounded by ``lookup_timeout_s``)."""
        if self._prefix_index is None or len(prompt_token_ids) < self._hasher.block_size:
            return {}
        # After a failed lookup, the next ones wait for a registry read that started later to succeed.
        if self._registry_error is not None or self._lookup_failed_at >= self._read_ok_at:
            return {}
        hashes = self._hasher.hash_blocks(prompt_token_ids)
        try:
            lookup = self._redis(self._prefix_index.longest_prefix, hashes)
            held = await asyncio.wait_for(lookup, self._lookup_timeout_s)
        except Exception as e:  # noqa: BLE001 - Redis away costs a routing hint, not the request
            self._lookup_failed_at = time.monotonic()
            self._index_outage.failed(e if str(e) else TimeoutError(f"{self._lookup_timeout_s} s passed"))
            return {}
        self._index_outage.ok()
        return {worker: blocks * self._hasher.block_size for worker, blocks in held.items()}

    def _reported(self, w: WorkerInfo, name: str) -> float:
        """A load figure the worker published, or 0 while the registry cannot be read (it is stale:
        this gateway's own counts are what it has)."""
        return w.load.get(name, 0.0) if self._registry_error is None else 0.0

    def _load_key(self, w: WorkerInfo) -> tuple[float, int, str]:
        # The reported load lags by up to a heartbeat; this gateway's own in-flight count does not,
        # so a burst spreads over the workers before their next beat.
        reported = self._reported(w, "num_running") + self._reported(w, "num_waiting")
        local = self._in_flight[w.grpc_address]
        return max(reported, local), local, w.id

    def forget(self, address: str) -> None:
        """Leave a worker that failed a call out of the choice for a registry refresh's time, while
        another is left (``pick_decode``)."""
        until = time.monotonic() + self._refresh_s
        self._failed[address] = max(self._failed.get(address, until), until)

    def mark_failed(self, address: str) -> None:
        """Leave a decode worker whose stream failed mid-request out of the choice for
        ``FAILED_HOLD_S``, not only until the next refresh, while another is left: its registry key
        outlives it by up to the heartbeat TTL, and the requests routed there meanwhile would each
        pay a failed call."""
        self._failed[address] = time.monotonic() + self.FAILED_HOLD_S

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

    def health_stub(self, address: str) -> health_pb2_grpc.HealthStub:
        """gRPC health of a worker, over the channel its requests use."""
        return health_pb2_grpc.HealthStub(self._channel(address))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tls_channel(address, self._tls, self.CHANNEL_OPTIONS)
        return channel

    def redial(self, address: str) -> None:
        """The next call to ``address`` on a new channel. A channel that failed to connect keeps
        failing every call at once with that error for its reconnect backoff (seconds, growing), also
        after a worker started again at the address: seen when a decode worker was stopped and
        started on its host again, and the gateway's first request to it answered 503. The old
        channel is closed once no call to the address is in flight."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._redialed.append((address, channel))

    async def _close_unused_channels(self, live: set[str]) -> None:
        for address in [a for a in self._channels if a not in live and not self._in_flight[a]]:
            await self._channels.pop(address).close()
        unused = [(a, c) for a, c in self._redialed if not self._in_flight[a]]
        self._redialed = [(a, c) for a, c in self._redialed if self._in_flight[a]]
        for _, channel in unused:
            await channel.close()

    async def close(self) -> None:
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
        channels = [*self._channels.values(), *(c for _, c in self._redialed)]
        self._channels, self._redialed = {}, []
        for channel in channels:
            await channel.close()
        pool, self._redis_pool = self._redis_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
