"""The engine on its own thread, with an asyncio front (vLLM V1's API-server / EngineCore split).

A worker's network front (gRPC, HTTP) runs on an asyncio loop and must never wait for a forward
step; the engine loop must never wait for the network. ``AsyncEngine`` runs ``LLMEngine.step()``
on a dedicated thread (torch releases the GIL inside its kernels) and hands each request's new
tokens and text to the caller's event loop as ``StreamDelta``s.

The engine is built on that thread too, so that it is the only thread that ever starts OpenMP
work. libgomp gives every thread that opens a parallel region its own pool; with a model loaded
on the main thread and stepped on another, the process holds more OpenMP threads than cores, and
libgomp then stops spinning between regions and puts its workers to sleep on a futex at every
barrier: ~230 context switches per token and batch-1 decode 30-40% slower (2-core host).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from baton.common.engine.block_pool import CacheEvents
from baton.common.engine.llm_engine import EngineFullError, LandedPrefix, LLMEngine
from baton.common.engine.outputs import RequestOutput, TopLogprobs
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import SampledToken

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineFullError", "RequestFailedError", "StreamDelta"]


class EngineDeadError(RuntimeError):
    """The engine cannot go on (an exception escaped ``LLMEngine.step()`` or a command): what every
    open stream, and every later ``generate``/``generate_remote``, raises. Not the request's fault:
    retry it on another worker (the decode worker answers gRPC UNAVAILABLE)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its step raised, or its logits were not finite) and went on
    serving the others (the decode worker answers gRPC INTERNAL). Raised by its stream."""


@dataclass
class StreamDelta:
    """What one request gained since its previous delta."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    published_unix_s: float = 0.0
    """When the engine thread handed it over (wall clock): the serving breakdown's zero."""
    top_logprobs: list[TopLogprobs] | None = None
    """One per token in ``token_ids`` when the request asks for ``logprobs`` > 0."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stop_strings: tuple[str, ...]
    sent_tokens: int = 0
    sent_text: int = 0
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        # Text that could be the start of a stop string is held back until it is decided.
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1

    def delta(self, out: RequestOutput) -> StreamDelta:
        c = out.outputs[0]
        text = c.text
        if not out.finished:
            end = len(text) - self.holdback
            while end > self.sent_text and text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for the next token
            text = text[:end]
        d = StreamDelta(
            request_id=out.request_id,
            token_ids=c.token_ids[self.sent_tokens :],
            logprobs=None if c.logprobs is None else c.logprobs[self.sent_tokens :],
            text=text[self.sent_text :] if len(text) > self.sent_text else "",
            finished=out.finished,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            top_logprobs=None if c.top_logprobs is None else c.top_logprobs[self.sent_tokens :],
        )
        self.sent_tokens = len(c.token_ids)
        self.sent_text = max(self.sent_text, len(text))
        return d


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class AsyncEngine:
    """Owns an ``LLMEngine`` and the thread that steps it. ``start()`` / ``stop()`` explicitly."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        on_cache_events: Callable[[CacheEvents], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        """``engine`` is an engine, or a factory that ``start()`` calls on the engine thread (what a
        worker should pass: see the module's docstring). ``on_cache_events`` receives each step's
        prefix-cache changes on the engine thread; it must only hand them over (e.g.
        ``CachePublisher.submit``). ``on_fatal`` is called once, on the engine thread, when the
        engine cannot go on, after every open stream has been failed with ``EngineDeadError``:
        the worker should stop serving and exit so that its supervisor restarts it."""
        if isinstance(engine, LLMEngine):
            built = engine
            self._factory: Callable[[], LLMEngine] = lambda: built
        else:
            self._factory = engine
        self._engine: LLMEngine | None = None
        self._on_cache_events = on_cache_events
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._submitted = 0  # requests put on the command queue and not yet taken by the engine
        self._submitted_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        # Engine thread only: requests parked for a remote prefill whose owner (``generate_remote``)
        # has not said yet that nothing writes their blocks any more, and those of them aborted.
        self._parked: set[str] = set()
        self._aborted_parked: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("AsyncEngine not started")
        return self._engine

    def start(self) -> LLMEngine:
        """Start the engine thread, build the engine on it, and return it once built; an error
        while building is raised here."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(built,), name="baton-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self._engine is None:
            self._thread.join()
            raise RuntimeError("building the engine failed") from self.error
        return self._engine

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """The engine thread is up and its engine alive (a dead engine's thread only refuses)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _dead_error(self) -> EngineDeadError:
        e = self.error
        dead = EngineDeadError(f"the engine failed: {type(e).__name__}: {e}")
        dead.__cause__ = e
        return dead

    # -- the caller's side (event loop thread) -------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int] = (),
        resume_text_chars: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Submit a request and yield its deltas until it finishes. Validation errors raise
        ``ValueError`` here, before anything is queued. Leaving the iteration early (a client
        that went away) aborts the request and frees its blocks. A migrated request passes the
        tokens it already streamed (``resume_token_ids``) and the characters of text the client
        has: its deltas start after both (``LLMEngine.add_request``)."""
        if self.error is not None:
            raise self._dead_error()
        self.engine.validate_request(prompt_token_ids, params, resume_token_ids)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.stop)
        stream.sent_tokens, stream.sent_text = len(resume_token_ids), max(resume_text_chars, 0)
        self._submit(("add", request_id, list(prompt_token_ids), params, stream, list(resume_token_ids)))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # refused at admission (e.g. a duplicate id): nothing to abort
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill: Callable[[list[int], int], Awaitable[SampledToken | LandedPrefix | None]],
    ) -> AsyncIterator[StreamDelta]:
        """Like ``generate``, with the prompt prefilled elsewhere: blocks are reserved on the engine
        thread, then ``prefill(block_ids, num_cached_tokens)`` runs on the caller's loop (it asks a
        prefill worker to fill those blocks and returns the first token, or None to prefill here
        instead, or a ``LandedPrefix`` to compute here only what did not land). The engine keeps
        stepping other requests meanwhile."""
        if self.error is not None:
            raise self._dead_error()
        self.engine.validate_request(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.stop)
        reserved: asyncio.Future = loop.create_future()
        self._submit(("reserve", request_id, list(prompt_token_ids), params, stream, reserved))
        finished = False
        try:
            try:
                got = await reserved
            except (ValueError, EngineFullError):
                finished = True  # refused at admission (e.g. a duplicate id): nothing to abort
                raise
            if got is None:  # no room to park it: prefill here, like any request
                finished = True
                async for d in self.generate(request_id, prompt_token_ids, params):
                    yield d
                return
            block_ids, num_cached = got
            token = await prefill(block_ids, num_cached)
            self._commands.put(("resume", request_id, token))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                # Also a request still parked: no prefill of it is running any more, so nothing
                # writes its blocks (``prefill`` returns only once its transfer is settled or its
                # blocks quarantined).
                self._commands.put(("abort", request_id, True))

    def abort(self, request_id: str) -> None:
        """End a request. One parked for a remote prefill keeps its blocks until that prefill
        returns: the transfer may still be writing them."""
        self._commands.put(("abort", request_id, False))

    def call_soon(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run ``fn(engine)`` on the engine thread between two steps (any thread may ask; it never
        waits): the one safe way to touch the engine's books from outside, e.g. to release blocks
        held for a transfer or to snapshot the prefix cache. An exception is logged, not raised."""
        self._commands.put(("call", fn))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self, built: threading.Event) -> None:
        try:
            self._engine = self._factory()
        except BaseException as e:
            self.error = e
            return
        finally:
            built.set()
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step(include_unfinished=True):
                        self._publish(out)
                    if self._on_cache_events is not None:
                        self._on_cache_events(self.engine.pool.take_events())
        except BaseException as e:  # the engine cannot go on: never a zombie that keeps serving
            self._die(e)
            self._refuse_commands()

    def _die(self, error: BaseException) -> None:
        """Fail every open stream with ``EngineDeadError``, then tell the owner (``on_fatal``)."""
        log.error("engine loop failed: the engine is dead", exc_info=error)
        self.error = error
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self._dead_error())
        self._streams.clear()
        if self._on_fatal is not None:
            try:
                self._on_fatal(error)
            except Exception:  # noqa: BLE001 - the owner's failure must not hide the engine's
                log.exception("on_fatal failed")

    def _refuse_commands(self) -> None:
        """A dead engine's thread answers every request still sent to it with ``EngineDeadError``
        until ``stop()``: one that raced past ``generate``'s check never waits forever."""
        while not self._stopping.is_set():
            try:
                self._refuse(self._commands.get(timeout=0.5))
            except queue.Empty:
                continue

    def _refuse(self, cmd: tuple) -> None:
        if cmd[0] in ("add", "reserve"):
            self._taken()
        if cmd[0] == "add":
            stream = cmd[4]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self._dead_error())
        elif cmd[0] == "reserve":
            stream, fut = cmd[4], cmd[5]
            stream.loop.call_soon_threadsafe(_settle, fut, None, self._dead_error())

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _submit(self, cmd: tuple) -> None:
        """Queue a new request for the engine thread, or raise ``EngineFullError`` when as many as
        the waiting queue holds are already on their way to it: a burst faster than the engine
        drains its commands (one step) costs bounded memory, and the excess a 429 at once."""
        cap = self.engine.config.max_waiting_requests
        with self._submitted_lock:
            if self._submitted >= cap:
                raise EngineFullError(
                    f"{self._submitted} requests are on their way to the engine (max_waiting_requests={cap})"
                )
            self._submitted += 1
        self._commands.put(cmd)

    def _taken(self) -> None:
        with self._submitted_lock:
            self._submitted -= 1

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind in ("add", "reserve"):
            self._taken()
        if kind == "add":
            _, rid, ids, params, stream, resumed = cmd
            try:
                self.engine.add_request(rid, ids, params, resume_token_ids=resumed)
            except (ValueError, EngineFullError) as e:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
                return
            self._streams[rid] = stream
        elif kind == "reserve":
            _, rid, ids, params, stream, fut = cmd
            try:
                got = self.engine.reserve_remote(rid, ids, params)
            except (ValueError, EngineFullError) as e:
                stream.loop.call_soon_threadsafe(_settle, fut, None, e)
                return
            if got is not None:
                self._streams[rid] = stream
                self._parked.add(rid)
            stream.loop.call_soon_threadsafe(_settle, fut, got, None)
        elif kind == "resume":
            self._resume(*cmd[1:])
        elif kind == "call":
            try:
                cmd[1](self.engine)
            except Exception:  # noqa: BLE001 - a helper's bug must not end the engine loop
                log.exception("a call on the engine thread failed")
        elif kind == "abort":
            _, rid, owner = cmd
            if rid in self._parked and not owner:
                self._aborted_parked.add(rid)  # freed when its prefill returns (``_resume``)
            else:
                self._parked.discard(rid)
                self._aborted_parked.discard(rid)
                self.engine.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait,
                    StreamDelta(rid, [], None, "", finished=True, finish_reason="abort"),
                )

    def _resume(self, rid: str, token: SampledToken | LandedPrefix | None) -> None:
        """A parked request's remote prefill returned: go on with it (or end it, aborted meanwhile).
        Blocks it left quarantined go back to the pool on this thread once settled."""
        self._parked.discard(rid)
        quarantine = token.quarantine if isinstance(token, LandedPrefix) else None
        if quarantine is not None and quarantine.on_settled is not None:
            quarantine.on_settled(lambda: self.call_soon(LLMEngine.release_quarantined))
        if rid in self._aborted_parked:
            self._aborted_parked.discard(rid)
            if quarantine is not None:
                self.engine.quarantine_blocks(quarantine)
            self.engine.abort_request(rid)
            return
        out = self.engine.resume_remote(rid, token)
        if out is not None:
            self._publish(out)

    def _publish(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        c = out.outputs[0]
        if c.finish_reason == "error":  # failed in the engine: its stream raises
            del self._streams[out.request_id]
            failed = RequestFailedError(f"request {out.request_id!r} failed: {c.error}")
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failed)
            return
        delta = stream.delta(out)
        if out.finished:
            del self._streams[out.request_id]
        delta.published_unix_s = time.time()
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
