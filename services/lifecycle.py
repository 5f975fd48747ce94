"""How a worker leaves service: drained on SIGTERM, or at once when its engine cannot go on.

Both ways start alike, in this order: new work RPCs are refused with gRPC UNAVAILABLE, health says
NOT_SERVING, and the worker deletes its registry key (so gateways stop routing to it within their
registry refresh, not at the key's TTL). A drain then lets the calls in flight finish up to its
deadline; a dead engine has already failed them. Whatever is left is ended with UNAVAILABLE too:
the gateway retries such a request on another worker before its first token and migrates it after.
Then the worker stops, and its process exits 0 after a drain, ``EX_SOFTWARE`` after a death, so
that a supervisor (``baton up``, Kubernetes) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)

EX_SOFTWARE = 70
"""Exit code of a worker whose engine died (sysexits.h: internal software error)."""

CUT_GRACE_S = 2.0
"""How long calls that were told to end (UNAVAILABLE) get to do so before the server stops."""


@dataclass(eq=False)
class _Call:
    """One work RPC in flight."""

    task: asyncio.Task
    waiting: bool = False
    """Awaiting the servicer (not gRPC's write): where a cancel lands inside the servicer."""
    cut: str | None = None
    """Why it must end with UNAVAILABLE, once told."""


class RpcGate(grpc.aio.ServerInterceptor):
    """The door of a worker's work RPCs (``methods``: full names such as ``/baton.v1.Decode/Generate``).

    It counts the calls in flight, refuses new ones with UNAVAILABLE once ``close`` gave a reason,
    ends the ones still running with UNAVAILABLE when told (``cut``), and turns any error of a call
    into UNAVAILABLE once the engine is known dead (``failure``). Other RPCs (health, Abort,
    Connect) pass untouched. Costs one generator layer per streamed message.
    """

    def __init__(self, methods: Iterable[str]) -> None:
        self.methods = frozenset(methods)
        self.health: Any = None
        """The server's ``grpc_health`` aio servicer, set NOT_SERVING by ``close``."""
        self.refusal: str | None = None
        """Why new work is refused; None while serving."""
        self.failure: str | None = None
        """What a call that fails is told once the engine is dead; None while it lives."""
        self._calls: set[_Call] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def close(self, reason: str) -> None:
        """Refuse new work with ``reason`` and report NOT_SERVING (for good)."""
        self.refusal = self.refusal or reason
        if self.health is not None:
            await self.health.enter_graceful_shutdown()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight (at most ``timeout_s``); whether none is."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        return not self._calls

    def cut(self, reason: str) -> int:
        """End every call in flight with UNAVAILABLE ``reason``; how many there were. A call in the
        servicer is cancelled there (which aborts its engine request); one that is writing ends
        once the write is done."""
        for call in self._calls:
            if call.cut is None:
                call.cut = reason
                if call.waiting:
                    call.task.cancel()
        return len(self._calls)

    # -- the interceptor ---------------------------------------------------------------------------
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _stream(self, behavior: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
        async def guarded(request, context):
            call = await self._admit(context)
            try:
                async with contextlib.aclosing(behavior(request, context)) as items:
                    while True:
                        call.waiting = True
                        try:
                            item = await anext(items)
                        except StopAsyncIteration:
                            return
                        finally:
                            call.waiting = False
                        yield item
                        if call.cut is not None:  # told while gRPC was writing
                            await context.abort(grpc.StatusCode.UNAVAILABLE, call.cut)
            except BaseException as e:
                await self._translate(e, call, context)
                raise
            finally:
                self._leave(call)

        return guarded

    def _unary(self, behavior: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        async def guarded(request, context):
            call = await self._admit(context)
            try:
                call.waiting = True
                return await behavior(request, context)
            except BaseException as e:
                await self._translate(e, call, context)
                raise
            finally:
                call.waiting = False
                self._leave(call)

        return guarded

    async def _admit(self, context) -> _Call:
        if self.refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
        task = asyncio.current_task()
        assert task is not None
        call = _Call(task)
        self._calls.add(call)
        self._idle.clear()
        return call

    def _leave(self, call: _Call) -> None:
        self._calls.discard(call)
        if not self._calls:
            self._idle.set()

    async def _translate(self, error: BaseException, call: _Call, context) -> None:
        """End a call that was cut, or that failed with the engine, with UNAVAILABLE (raises the
        abort); any other error stands."""
        if isinstance(error, grpc.aio.AbortError):
            return  # the servicer (or a cut) already chose the status
        if isinstance(error, asyncio.CancelledError):
            if call.cut is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, call.cut)
            return  # the client went away
        if self.failure is not None and isinstance(error, Exception):
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)


class Lifecycle:
    """Drain and death of one worker, around its ``RpcGate``.

    The worker hands over how it leaves the registry (``leave_registry``, blocking: it runs on a
    thread), how it stops (``stop``) and who to tell the exit code (``on_exit``). What is in flight
    is the gate's calls: a Prefill call lasts until its KV transfer has landed.
    """

    def __init__(
        self,
        gate: RpcGate,
        leave_registry: Callable[[], None],
        stop: Callable[[], Awaitable[None]],
        on_exit: Callable[[int], None] | None = None,
    ) -> None:
        self.gate = gate
        self._leave_registry = leave_registry
        self._stop = stop
        self._on_exit = on_exit
        self._dying: asyncio.Task | None = None

    async def drain(self, timeout_s: float) -> bool:
        """Leave service, let the work in flight finish within ``timeout_s``, end the rest with
        UNAVAILABLE, stop; whether everything finished in time."""
        started = time.monotonic()
        await self._leave("draining")
        log.info("draining: %d request(s) in flight, up to %.1f s", self.gate.in_flight, timeout_s)
        done = await self.gate.wait_idle(timeout_s)
        if not done:
            left = self.gate.cut("draining: the worker's drain deadline passed")
            log.warning(
                "drain deadline: ended %d request(s) with UNAVAILABLE for the gateway to resume", left
            )
            await self.gate.wait_idle(CUT_GRACE_S)
        await self._stop()
        log.info("drained in %.2f s", time.monotonic() - started)
        return done

    def on_fatal(self, loop: asyncio.AbstractEventLoop) -> Callable[[BaseException], None]:
        """What to give ``AsyncEngine(on_fatal=...)``: called on the engine thread, it has ``loop``
        take the worker out of service and exit with ``EX_SOFTWARE``."""

        def engine_died(error: BaseException) -> None:
            loop.call_soon_threadsafe(self._die_soon, error)

        return engine_died

    def _die_soon(self, error: BaseException) -> None:
        self.gate.failure = self.gate.failure or _failure(error)  # before any failed stream resumes
        if self._dying is None:
            self._dying = asyncio.ensure_future(self.die(error))

    async def die(self, error: BaseException) -> None:
        """The engine cannot go on: out of service at once, the calls in flight (already failed by
        the engine) end with UNAVAILABLE, stop, and ask to exit ``EX_SOFTWARE``."""
        reason = _failure(error)
        log.error("%s: leaving service and exiting with code %d", reason, EX_SOFTWARE)
        self.gate.failure = reason
        try:
            await self._leave(reason)
            if not await self.gate.wait_idle(1.0):
                self.gate.cut(reason)
                await self.gate.wait_idle(1.0)
            await asyncio.wait_for(self._stop(), 5.0)
        except Exception:  # noqa: BLE001 - exiting matters more than a clean stop
            log.exception("stopping a worker whose engine died")
        finally:
            if self._on_exit is not None:
                self._on_exit(EX_SOFTWARE)

    async def _leave(self, reason: str) -> None:
        """Refuse new work, NOT_SERVING, and out of the registry (bounded: Redis may be away, and
        then the key expires at its TTL)."""
        await self.gate.close(reason)
        try:
            await asyncio.wait_for(asyncio.to_thread(self._leave_registry), 3.0)
        except Exception as e:  # noqa: BLE001 - TimeoutError or Redis errors
            log.warning("could not leave the registry (the key expires at its TTL): %r", e)


def _failure(error: BaseException) -> str:
    return f"the worker's engine failed: {type(error).__name__}: {error}"
