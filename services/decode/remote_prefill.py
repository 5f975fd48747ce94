"""The decode worker's side of a remote prefill: it asks a prefill worker to fill blocks it
reserved, waits for the KV to land, and when the prefill worker fails part-way keeps what landed
(``LandedPrefix``) so that the engine computes only the rest."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.common.api.convert import top_logprobs_from_proto
from baton.common.engine.llm_engine import LandedPrefix, Quarantine
from baton.common.engine.scheduler import SampledToken
from baton.common.transfer import TransferError
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.grpc_tls import GrpcTLS
from baton.services.grpc_tls import channel as tls_channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefillConfig:
    """The decode worker's settings that its remote prefills run by (``DecodeWorkerConfig.remote_prefill``)."""

    threshold: int
    """Prompts with fewer uncached tokens than this are prefilled here."""
    block_size: int
    """Tokens per KV block of the engine."""
    timeout_s: float
    """Bound on one remote prefill (RPC and transfer)."""
    stall_s: float
    """A started transfer that lands no block for this long is given up (the landed blocks kept)."""
    failed_hold_s: float
    """A prefill worker that failed is left out of the choice this long."""
    tls: GrpcTLS
    """TLS of the channels to prefill workers."""


class PrefillStalled(Exception):
    """The transfer of a remote prefill made no progress for ``prefill_stall_timeout_s``."""


@dataclass(frozen=True)
class RemoteFailure:
    """How one remote prefill failed (the latest is ``RemotePrefill.last_failure``)."""

    request_id: str
    address: str
    noticed: float
    """``time.monotonic()`` when this worker noticed it."""
    reason: str
    kept_tokens: int
    """Prompt tokens whose KV had landed, kept rather than recomputed."""
    quarantined_blocks: int = 0
    """Reserved blocks a message was still being written into (a receive the transport cannot
    cancel): swapped for fresh ones, and out of the pool until the receive settles."""


class RemotePrefill:
    """Asks a prefill worker to fill reserved blocks, and waits for the KV to land.

    A prefill worker that fails mid-prompt costs the request latency, never the request. A dead
    one fails the Prefill RPC at once (its connection closes); a hung one within ~2 s (gRPC
    keepalive: a ping every second while the call is open, unanswered for another second); a live
    one whose transfer stops, after ``prefill_stall_timeout_s`` with no block landing. (Its registry
    key expiring, the TTL after its last heartbeat, never comes first; nor is a worker gone from the
    registry a failure: a draining one leaves it at once and finishes its prefills.) Then the
    transfer is given up (``cancel``: nothing more is claimed), the blocks that landed whole from
    the start of the reserved range are kept and only the rest of the prompt is computed here, at
    once (``LandedPrefix``). A message the dead worker left half-sent has receives posted into its
    blocks that the transport cannot cancel (ucx; gloo fails them when the peer dies): those blocks
    are quarantined, the request computes in fresh ones, and the pool takes them back once the
    receive settles (the transfer deadline), so a late write can never reach another request's KV.
    The worker is left out of the choice for ``failed_prefill_hold_s``: its registry key outlives it
    by up to the heartbeat TTL. A prefill worker that answers DATA_LOSS (alive, but its sends
    failed, so it may have reused blocks this worker was still reading) gets nothing kept: the
    whole prompt is recomputed.
    """

    # Keepalive on the channels to prefill workers (their servers accept pings this often:
    # ``worker_base.GRPC_SERVER_OPTIONS``); only while a call is open. grpcio 1.85 enforces the
    # wait for the ping's ack through ``ping_timeout_ms``: with ``keepalive_timeout_ms`` alone, a
    # call to a SIGSTOPped worker hung until its deadline (measured: 1.7 s with it).
    CHANNEL_OPTIONS = (
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 1000),
        ("grpc.http2.ping_timeout_ms", 1000),
        ("grpc.http2.max_pings_without_data", 0),
    )
    POLL_S = 0.05
    """How often an open Prefill RPC's transfer progress is looked at."""
    SETTLE_GRACE_S = 0.5
    """How long a given-up transfer is waited for when the receiver cannot say which of its blocks
    are still being written."""

    def __init__(
        self,
        receiver,
        descriptor,
        pick_prefill,
        config: RemotePrefillConfig,
        locations=None,
        worker_id="",
        bytes_per_token: int = 0,
        kv_layout: str = "",
        known_prefill=lambda: frozenset(),
        rank_destinations=(),
    ):
        """``locations`` (a started ``LocationRecorder``) records where each transfer lands and its
        state, in the background. ``pick_prefill(exclude)`` is an async function returning the
        address of a prefill worker not in ``exclude``, or None; ``known_prefill()`` the addresses
        of the prefill workers in the registry, the only ones this worker ever dials."""
        self.known_prefill = known_prefill
        self.receiver = receiver
        self.locations = locations
        self.worker_id = worker_id
        self.descriptor_json = json.dumps(descriptor.to_dict())
        self.backend = descriptor.backend
        self.pick_prefill = pick_prefill
        self.threshold = config.threshold
        self.block_size = config.block_size
        self.timeout_s = config.timeout_s
        self.stall_s = config.stall_s
        self.failed_hold_s = config.failed_hold_s
        self.bytes_per_token = bytes_per_token
        self.kv_layout = kv_layout
        """This worker's ``model_runner.kv_cache_layout``: a prefill worker with another refuses."""
        self.rank_destinations = list(rank_destinations)
        """A parallel worker's ranks: their layers and heads (``baton_pb2.RankDestination``;
        ``tp_transfer``)."""
        self.results: dict[str, baton_pb2.PrefillResponse] = {}
        """The prefill worker's answer for each request prefilled remotely, until its stream ends."""
        self.tls = config.tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._failed: dict[str, float] = {}  # address -> until when it is left out (monotonic)
        self.failures: deque[RemoteFailure] = deque(maxlen=256)
        """The latest failures, oldest first."""
        self.failures_by_reason: Counter[str] = Counter()
        self.kept_tokens_total = 0
        self.quarantined_blocks = 0
        """Blocks out of the pool now for receives that may still write them."""

    def _stub(self, address: str) -> baton_pb2_grpc.PrefillStub:
        if address not in self._channels:
            self._channels[address] = tls_channel(address, self.tls, self.CHANNEL_OPTIONS)
        return baton_pb2_grpc.PrefillStub(self._channels[address])

    async def prefill(
        self, request, params, block_ids: list[int], num_cached: int
    ) -> SampledToken | LandedPrefix | None:
        """The first token once the prompt's KV is in ``block_ids``; a ``LandedPrefix`` when the
        remote prefill failed part-way; None to prefill here."""
        ids = request.prompt_token_ids
        if len(ids) - num_cached < self.threshold:
            return None
        address = await self._choose(request.prefill_address)
        if not address:
            return None
        dst = block_ids[num_cached // self.block_size :]
        rid = request.request_id
        handle = self.receiver.expect(rid, dst, self.timeout_s)
        self._record(rid, dst, "pending")
        call = None
        try:
            await self.receiver.ready(rid, self.timeout_s)  # every rank expects it before any sends
            call = self._stub(address).Prefill(
                self._prefill_request(request, num_cached, dst), timeout=self.timeout_s
            )
            resp = await self._answer(call, rid)
            await handle.wait_async(self.timeout_s)
        except (grpc.aio.AioRpcError, TransferError, PrefillStalled) as e:
            if call is not None:
                call.cancel()  # a hung or stalled worker aborts the prompt too
            return await self._recover(rid, address, handle, dst, num_cached, len(ids), e)
        except asyncio.CancelledError:
            if call is not None:
                call.cancel()
            await self._release(rid, handle)
            self._record(rid, dst, "cancelled")
            raise
        self._record(rid, dst, "landed")
        self.results[rid] = resp
        logprob = resp.first_logprob if params.logprobs is not None else None
        top = top_logprobs_from_proto(resp.first_top_logprobs) if params.logprobs else None
        return SampledToken(resp.first_token_id, logprob, top)

    def _prefill_request(self, request, num_cached: int, dst: list[int]) -> baton_pb2.PrefillRequest:
        return baton_pb2.PrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=request.params,
            destination=baton_pb2.TransferDescriptor(backend=self.backend, extra_json=self.descriptor_json),
            num_skip_tokens=num_cached,
            dst_block_ids=dst,
            kv_layout=self.kv_layout,
            rank_destinations=self.rank_destinations,
        )

    async def _choose(self, suggested: str) -> str | None:
        """``suggested`` (the gateway's pick), unless it failed lately or is no prefill worker of
        the registry (an address in a request is never dialled as such): then another one."""
        now = time.monotonic()
        self._failed = {a: until for a, until in self._failed.items() if until > now}
        if suggested and suggested not in self._failed and suggested in self.known_prefill():
            return suggested
        return await self.pick_prefill(frozenset(self._failed))

    async def _answer(self, call, rid: str) -> baton_pb2.PrefillResponse:
        """The Prefill RPC's answer; ``PrefillStalled`` when no block lands for ``stall_s`` once
        the transfer has started (a worker with a queue may take long to start a prompt)."""
        answer = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=self.POLL_S)
                if done:
                    return answer.result()
                progress = self.receiver.progress(rid)
                if progress is not None and progress.last_landed is not None:
                    quiet = time.monotonic() - progress.last_landed
                    if quiet > self.stall_s:
                        raise PrefillStalled(
                            f"no KV block landed for {quiet:.1f} s "
                            f"({progress.blocks_landed} of {progress.blocks_expected} in)"
                        )
        finally:
            answer.cancel()

    @property
    def failures_total(self) -> int:
        return sum(self.failures_by_reason.values())

    @property
    def last_failure(self) -> RemoteFailure | None:
        return self.failures[-1] if self.failures else None

    async def _recover(
        self, rid: str, address: str, handle, dst: list[int], num_cached: int, prompt_len: int, error
    ) -> LandedPrefix | None:
        """Give the transfer up and say what of it to keep, at once: blocks a message may still be
        written into are quarantined, not waited for."""
        noticed = time.monotonic()
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        lost = isinstance(error, PrefillStalled) or code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        if lost:
            self._failed[address] = noticed + self.failed_hold_s
        self.receiver.cancel(rid, sender_lost=lost)
        landed, writing = await self._landed_and_writing(rid, handle, dst)
        if code == grpc.StatusCode.DATA_LOSS:
            landed = frozenset()
        first_missing = next((i for i, b in enumerate(dst) if b not in landed), len(dst))
        kept = max(0, min(num_cached + first_missing * self.block_size, prompt_len - 1) - num_cached)
        quarantine = self._quarantine(handle, writing)
        reason = code.name if code is not None else type(error).__name__
        self.failures_by_reason[_reason_label(code, error)] += 1
        self.kept_tokens_total += kept
        self.failures.append(RemoteFailure(rid, address, noticed, reason, kept, len(writing)))
        log.warning(
            "remote prefill of %s via %s failed (%s: %s): %d prompt tokens landed and are kept, the rest "
            "is computed here; %d blocks a message may still write are quarantined",
            rid,
            address,
            reason,
            error.details() if code is not None else error,
            kept,
            len(writing),
        )
        self._record(rid, dst, "failed")
        if kept or quarantine is not None:
            return LandedPrefix(num_cached + kept, quarantine)
        return None

    async def _landed_and_writing(
        self, rid: str, handle, dst: list[int]
    ) -> tuple[frozenset[int], frozenset[int]]:
        """After ``cancel``: the blocks that landed whole, and those a message may still write."""
        progress = None if handle.done() else self.receiver.progress(rid)
        if progress is not None and progress.writing_block_ids is None:
            # A receiver that cannot say (spread over ranks) settles within its ranks' round trip
            # when nothing is being written; else keep nothing and quarantine every block.
            try:
                await handle.wait_async(self.SETTLE_GRACE_S)
            except TransferError:
                pass
            if not handle.done():
                return frozenset(), frozenset(dst)
            progress = None
        if progress is None:  # settled: nothing writes any more
            return frozenset(handle.landed_block_ids), frozenset()
        return progress.landed_block_ids or frozenset(), progress.writing_block_ids or frozenset()

    def _quarantine(self, handle, block_ids: frozenset[int]) -> Quarantine | None:
        """The blocks to keep out of the pool until ``handle`` settles (None: none)."""
        if not block_ids:
            return None
        n = len(block_ids)
        self.quarantined_blocks += n

        def settled(_) -> None:
            self.quarantined_blocks -= n

        handle.add_done_callback(settled)
        return Quarantine(
            tuple(sorted(block_ids)), handle.done, lambda fn: handle.add_done_callback(lambda _: fn())
        )

    async def connect(self, address: str) -> None:
        """Have the prefill worker at ``address`` connect its KV transport to this worker's
        receiver now (over the channel later prompts use), not at the first prompt."""
        await self._stub(address).Connect(
            baton_pb2.ConnectRequest(
                destination=baton_pb2.TransferDescriptor(
                    backend=self.backend, extra_json=self.descriptor_json
                ),
                kv_layout=self.kv_layout,
                rank_destinations=self.rank_destinations,
            ),
            timeout=min(self.timeout_s, 10.0),
        )

    def _record(self, rid: str, block_ids: list[int], state: str) -> None:
        """Publish the transfer's destination and state, in the background (a Redis that is away
        only loses the record)."""
        if self.locations is not None:
            self.locations.record(rid, self.worker_id, block_ids, state)

    async def _release(self, rid: str, handle) -> None:
        """Stop expecting the transfer and wait until nothing more can land in its blocks (bounded
        by the receiver's deadlines), even if the request is cancelled meanwhile: its blocks are
        freed right after this."""
        self.receiver.cancel(rid)
        settled = asyncio.ensure_future(self._settled(handle))
        try:
            await asyncio.shield(settled)
        except asyncio.CancelledError:
            await settled
            raise

    async def _settled(self, handle) -> None:
        try:
            await handle.wait_async(self.timeout_s)
        except TransferError:
            pass

    async def close(self) -> None:
        if self.locations is not None:
            await asyncio.to_thread(self.locations.close)
        for channel in self._channels.values():
            await channel.close()


def _reason_label(code: grpc.StatusCode | None, error: BaseException) -> str:
    """``baton:remote_prefill_failures``' reason: the Prefill call's gRPC status, or what failed."""
    if code is not None:
        return code.name.lower()
    return "stalled" if isinstance(error, PrefillStalled) else "transfer_error"


class RemotePrefillCollector:
    """``baton:remote_prefill_failures{reason}`` and ``baton:remote_prefill_kept_tokens`` (counters),
    ``baton:kv_blocks_quarantined`` (a gauge)."""

    def __init__(self, remote: RemotePrefill, labels: dict[str, str]):
        self.remote = remote
        self.labels = labels

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        failures = CounterMetricFamily(
            "baton:remote_prefill_failures",
            "Remote prefills that failed (the prompt was finished here), by how it was noticed: a gRPC "
            "status of the Prefill call (UNAVAILABLE: the prefill worker is gone or hung), stalled, ...",
            labels=[*names, "reason"],
        )
        for reason, n in sorted(self.remote.failures_by_reason.items()):
            failures.add_metric([*values, reason], n)
        yield failures
        kept = CounterMetricFamily(
            "baton:remote_prefill_kept_tokens",
            "Prompt tokens whose KV landed before their remote prefill failed, kept.",
            labels=names,
        )
        kept.add_metric(values, self.remote.kept_tokens_total)
        yield kept
        quarantined = GaugeMetricFamily(
            "baton:kv_blocks_quarantined",
            "KV blocks out of the pool because a receive given up mid-message may still write them.",
            labels=names,
        )
        quarantined.add_metric(values, self.remote.quarantined_blocks)
        yield quarantined
