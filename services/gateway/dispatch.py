"""Sends decode requests to workers and merges their token streams.

One HTTP request becomes one decode request per choice (prompts x ``n``); their ``GenerateChunk``
streams are merged by choice index. Closing a stream (a client that went away) cancels its gRPC
calls, and the worker aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace

import grpc

from baton.common.api.convert import params_to_proto
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.structured_spec import REFUSAL_PREFIX
from baton.protos import baton_pb2
from baton.services.gateway.errors import APIError, bad_request, unavailable
from baton.services.gateway.metrics import GatewayMetrics
from baton.services.gateway.router import NoWorkerError, Router

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Workers tried for one decode request when they are unreachable, or full, before the first token."""
MAX_PATIENCE_DOUBLINGS = 3
"""Each call of a stream that failed or stalled doubles the progress deadline of the stream's later
calls, up to this many times (3 s, 6 s, 12 s, 24 s): a hung worker is left at the first deadline,
while a host too busy to answer within it (every worker slow, a resumed request prefilled anew) is
given time instead of having its streams moved back and forth."""
MIGRATABLE = frozenset(
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN]
)
"""A stream that fails with these after its first token is resumed on another decode worker: the
worker died, lost its connection, was drained or cancelled the call itself. Not INTERNAL (a request
that failed in the engine fails again anywhere), not the client's errors, not the deadline."""


class Stalled(Exception):
    """A decode worker sent nothing within the progress deadline (hung, not dead)."""


@dataclass(frozen=True)
class SubRequest:
    """One decode request: one choice of one prompt."""

    index: int
    """The choice's index in the response (``prompt_index * n + j``)."""
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def fan_out(request_id: str, prompts: Sequence[list[int]], params: SamplingParams) -> list[SubRequest]:
    """``n`` decode requests per prompt; with a seed, choice ``j`` gets ``seed + j`` (as ``LLM`` does).
    A single choice keeps ``request_id``; several get ``request_id-<index>``."""
    single = len(prompts) * params.n == 1
    subs = []
    for p, ids in enumerate(prompts):
        for j in range(params.n):
            index = p * params.n + j
            seed = None if params.seed is None else params.seed + j
            subs.append(
                SubRequest(
                    index=index,
                    prompt_index=p,
                    request_id=request_id if single else f"{request_id}-{index}",
                    prompt_token_ids=ids,
                    params=replace(params, n=1, seed=seed),
                )
            )
    return subs


def rpc_error(e: grpc.aio.AioRpcError, prompt_param: str, spec_param: str | None = None) -> APIError:
    """The client's view of a failed call to a worker. ``prompt_param`` and ``spec_param`` name the
    request's prompt and output constraint as the client gave them (``messages``, ``guided_regex``...)."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if details.startswith("This model's maximum context length"):  # OpenAI's code and param
            return APIError(400, details, param=prompt_param, code="context_length_exceeded")
        if spec_param and details.startswith(REFUSAL_PREFIX):  # a spec only the compiler could refuse
            return bad_request(f"{spec_param}: {details.removeprefix(REFUSAL_PREFIX)}", param=spec_param)
        word = details.split(" ", 1)[0]
        return bad_request(details, param=prompt_param if word == "prompt" else None)
    if code == grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"decode worker unavailable: {details}", code="worker_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request timed out", type="timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(429, details, type="rate_limit_error", code="worker_queue_full")
    return APIError(500, f"decode worker error ({code.name}): {details}", type="server_error")


@dataclass
class _Progress:
    """What one decode request has streamed so far: what a migration resumes from."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    finished: bool = False
    migrations: int = 0
    """Calls that failed or stalled mid-stream, each resumed on another call."""
    unproductive: int = 0
    """Of those, the ones since the latest token arrived (what ``max_migrations`` bounds)."""
    last: float | None = None
    """When its latest token arrived (``Dispatcher._observe``)."""

    def add(self, chunk: baton_pb2.GenerateChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text_chars += len(chunk.text)
        self.finished = self.finished or bool(chunk.finish_reason)
        if chunk.token_ids:
            self.unproductive = 0

    def patience(self, progress_timeout_s: float) -> float | None:
        """The longest a call may go without a chunk: none before the first token (the request's
        deadline and the channel's keepalive apply), then the progress deadline, doubled for each
        migration so far (``MAX_PATIENCE_DOUBLINGS``)."""
        if not self.token_ids:
            return None
        return progress_timeout_s * 2 ** min(self.migrations, MAX_PATIENCE_DOUBLINGS)

    def request(self, base: baton_pb2.GenerateRequest) -> baton_pb2.GenerateRequest:
        """``base``, or, once tokens were sent, ``base`` resumed after them (prefilled where it goes)."""
        if not self.token_ids:
            return base
        resumed = baton_pb2.GenerateRequest()
        resumed.CopyFrom(base)
        resumed.prefill_address = resumed.prefill_worker_id = ""
        resumed.resume_token_ids[:] = self.token_ids
        resumed.resume_text_chars = self.text_chars
        return resumed


@dataclass
class _Attempts:
    """The decode workers one request has tried."""

    tried: list[str] = field(default_factory=list)
    reachable: set[str] = field(default_factory=set)
    """Workers that lost this stream while their process was there (a keepalive starved on a busy
    host, a stall, a dropped connection): with no other worker left, they may resume it, as a new
    request would be sent there. One that refuses the connection (a dead process) is not tried
    again. Each try is a migration."""
    refused: APIError | None = None
    """The last "queue full" answer, if every worker is full."""
    redialed: set[str] = field(default_factory=set)
    """Workers unreachable before the first token, whose channel was replaced (``Router.redial``):
    with no other worker left, each is tried once more on its new channel. The old one may have
    answered from its reconnect backoff, not from the worker there now."""
    redial_pending: set[str] = field(default_factory=set)

    def none_left(self, e: NoWorkerError, progress: _Progress) -> None:
        """No worker to pick: the reachable ones (or the redialed) are let in again, or the client
        is told why."""
        if self.reachable:
            self.tried = [a for a in self.tried if a not in self.reachable]
            self.reachable.clear()
            return
        if self.redial_pending:
            self.tried = [a for a in self.tried if a not in self.redial_pending]
            self.redial_pending.clear()
            return
        if self.refused is not None:
            raise self.refused from None  # every worker tried is full: 429, not 503
        if progress.token_ids:
            raise unavailable(
                f"the decode worker failed mid-stream and no other can resume it: {e}",
                code="no_decode_worker",
            ) from None
        raise unavailable(str(e), code="no_decode_worker") from None


@dataclass(frozen=True)
class _Failure:
    """One call that failed or stalled, and on which worker."""

    error: grpc.aio.AioRpcError | Stalled
    address: str

    @property
    def code(self) -> grpc.StatusCode | None:
        """The call's status; None for a stall (no progress within the deadline)."""
        return self.error.code() if isinstance(self.error, grpc.aio.AioRpcError) else None

    @property
    def unreachable(self) -> bool:
        """The worker's address refused the connection: no process listens there any more."""
        if not isinstance(self.error, grpc.aio.AioRpcError):
            return False
        details = self.error.details() or ""
        return "Connection refused" in details or "failed to connect to all addresses" in details


class Dispatcher:
    """Runs decode requests on the workers the router picks."""

    def __init__(
        self,
        router: Router,
        metrics: GatewayMetrics,
        timeout_s: float,
        max_migrations: int = 3,
        progress_timeout_s: float = 10.0,
    ) -> None:
        """``max_migrations``: how many times in a row one decode request may move to another
        worker without a new token;
        ``progress_timeout_s``: the longest a started stream may go without a chunk, before its
        first migration (``_Progress.patience``)."""
        self._router = router
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._max_migrations = max_migrations
        self._progress_timeout_s = progress_timeout_s

    async def merged(
        self, subs: Sequence[SubRequest], arrival: float, prompt_param: str, spec_param: str | None = None
    ) -> AsyncGenerator[tuple[int, baton_pb2.GenerateChunk], None]:
        """``(choice index, chunk)`` from every decode request, as they arrive. Errors raise
        ``APIError``; leaving early cancels every call."""
        streams = [self.stream(s, arrival, prompt_param, spec_param) for s in subs]
        if len(streams) == 1:
            async for chunk in streams[0]:
                yield subs[0].index, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[baton_pb2.GenerateChunk]) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((index, chunk, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, None, e))
                return
            queue.put_nowait((index, None, None))

        tasks = [asyncio.create_task(pump(s.index, st)) for s, st in zip(subs, streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                    continue
                yield index, chunk
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream(
        self, sub: SubRequest, arrival: float, prompt_param: str, spec_param: str | None = None
    ) -> AsyncIterator[baton_pb2.GenerateChunk]:
        """One decode request's chunks. A worker that is unreachable before the first chunk is left
        out and another one tried; one that fails or stalls mid-stream is left out of routing and
        the request migrates: it resumes on another worker from the tokens and text already sent,
        so that the chunks go on without a gap or a repeat (greedy: token-identical). With no other
        worker left, one that is still reachable resumes the stream itself."""
        prefill = await self._router.pick_prefill(sub.prompt_token_ids)
        base = baton_pb2.GenerateRequest(
            request_id=sub.request_id,
            prompt_token_ids=sub.prompt_token_ids,
            params=params_to_proto(sub.params),
            prefill_address=prefill.worker.grpc_address if prefill else "",
            prefill_worker_id=prefill.worker.id if prefill else "",
        )
        progress, attempts = _Progress(), _Attempts()
        deadline = time.monotonic() + self._timeout_s
        with contextlib.ExitStack() as queued:
            if prefill is not None:
                # Counted at once, before anything awaits, so that requests picking at the same
                # moment see this prompt queued there and spread over the prefill workers.
                queued.enter_context(
                    self._router.track_prefill(prefill.worker.grpc_address, prefill.uncached_tokens)
                )
            while True:
                try:
                    worker = await self._router.pick_decode(
                        exclude=attempts.tried, prompt_token_ids=sub.prompt_token_ids
                    )
                except NoWorkerError as e:
                    attempts.none_left(e, progress)  # raises, unless a reachable worker may resume it
                    continue
                address = worker.grpc_address
                request = progress.request(base)
                call = self._router.decode_stub(address).Generate(
                    request, timeout=max(deadline - time.monotonic(), 0.001)
                )
                try:
                    with self._router.track(address), self._metrics.in_flight.track_inprogress():
                        async for chunk in self._chunks(call, progress):
                            queued.close()  # the prompt is prefilled once a chunk arrives
                            progress.last = self._observe(chunk, arrival, progress.last)
                            progress.add(chunk)
                            yield chunk
                    return
                except (grpc.aio.AioRpcError, Stalled) as e:
                    if progress.finished:
                        return  # everything arrived; only the call's ending failed
                    failure = _Failure(e, address)
                    self._after(failure, sub.request_id, attempts, progress, (prompt_param, spec_param))
                finally:
                    call.cancel()  # a no-op once the call is done; aborts it on the worker otherwise

    def _after(
        self,
        failure: _Failure,
        request_id: str,
        attempts: _Attempts,
        progress: _Progress,
        params: tuple[str, str | None],
    ) -> None:
        """What a failed or stalled call leads to: returns to try again (another worker, or the same
        one resuming), or raises the client's error."""
        code, address = failure.code, failure.address
        if not progress.token_ids:
            # Unreachable, or its queue is full: another worker may take it now.
            elsewhere = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                attempts.refused = rpc_error(failure.error, params[0])  # type: ignore[arg-type]
            if code == grpc.StatusCode.UNAVAILABLE:  # logged: the 503 that may follow does not say why
                log.warning(
                    "decode worker %s unavailable before the first token of %s: %s",
                    address,
                    request_id,
                    failure.error.details() if isinstance(failure.error, grpc.aio.AioRpcError) else "",
                )
            if code == grpc.StatusCode.UNAVAILABLE and address not in attempts.redialed:
                self._router.redial(address)
                attempts.redialed.add(address)
                attempts.redial_pending.add(address)
            if elsewhere and len(attempts.tried) < MAX_ATTEMPTS - 1:
                self._router.forget(address)
                attempts.tried.append(address)
                return
        if (code in MIGRATABLE or code is None) and progress.token_ids:
            self._migrate(failure, request_id, attempts, progress)
            return
        if not isinstance(failure.error, grpc.aio.AioRpcError):
            raise unavailable("the decode worker stopped making progress") from None
        raise rpc_error(failure.error, *params) from None

    def _migrate(self, failure: _Failure, request_id: str, attempts: _Attempts, progress: _Progress) -> None:
        """Leave the worker that lost the stream out of routing and resume elsewhere; with no other
        worker left, it resumes there unless it refused the connection."""
        if progress.unproductive >= self._max_migrations:
            raise unavailable(
                f"the request failed on {progress.unproductive + 1} decode workers in a row "
                "without a new token",
                code="too_many_migrations",
            ) from None
        code, address = failure.code, failure.address
        progress.migrations += 1
        progress.unproductive += 1
        self._metrics.migrated("stalled" if code is None else "failed")
        log.warning(
            "decode worker %s failed mid-stream (%s): resuming %s after %d tokens",
            address,
            "no progress" if code is None else code.name,
            request_id,
            len(progress.token_ids),
        )
        self._router.mark_failed(address)
        attempts.tried.append(address)
        if not failure.unreachable:
            attempts.reachable.add(address)

    async def _chunks(self, call, progress: _Progress) -> AsyncIterator[baton_pb2.GenerateChunk]:
        """The call's chunks; once the request has its first token, a gap longer than the progress
        deadline (``_Progress.patience``) raises ``Stalled`` (a hung worker: a dead one fails the
        call by itself)."""
        it = call.__aiter__()
        while True:
            wait = progress.patience(self._progress_timeout_s)
            try:
                chunk = await asyncio.wait_for(anext(it), wait)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise Stalled from None
            yield chunk

    def _observe(self, chunk: baton_pb2.GenerateChunk, arrival: float, last: float | None) -> float | None:
        """Record a chunk's latencies and counts; returns the time of the latest token."""
        m, now = self._metrics, time.perf_counter()
        m.chunk_received(chunk)
        if chunk.finish_reason:
            m.latency.e2e.observe(now - arrival)
            m.finished(chunk.finish_reason)
        if not chunk.token_ids:
            return last
        if last is None:
            m.latency.ttft.observe(now - arrival)
            m.prompt_tokens.inc(chunk.num_prompt_tokens)
        else:
            m.latency.itl.observe(now - last)
        m.generation_tokens.inc(len(chunk.token_ids))
        return now
