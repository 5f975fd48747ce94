"""Streaming to HTTP clients, and noticing when they leave.

uvicorn does not cancel a handler whose client disconnected, and a stream's body only learns of it
when a write fails; both waits here watch for ``http.disconnect`` themselves, so that a client that
leaves cancels its worker calls at once (the worker aborts the request and frees its blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from baton.services.gateway.errors import APIError
from baton.services.gateway.responses import ResponseBuilder, sse

T = TypeVar("T")


async def collect(builder: ResponseBuilder, chunks: AsyncIterator) -> None:
    async for index, chunk in chunks:
        builder.add(index, chunk)


class ClientGone(Exception):
    """The client disconnected before its response started."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of ``work``, or ``ClientGone`` (with ``work`` cancelled) if the client leaves
    first: uvicorn does not cancel a handler whose client went away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


async def events(
    builder: ResponseBuilder,
    first,
    chunks: AsyncGenerator,
    on_written: Callable[[object], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE body: role chunks (chat), one chunk per worker chunk, the usage chunk, ``[DONE]``.
    ``on_written(chunk)`` runs as each worker chunk's event goes to the HTTP server."""
    try:
        for body in builder.start_chunks():
            yield sse(body)
        item = first
        while item is not None:
            index, chunk = item
            body = builder.delta_chunk(builder.add(index, chunk), chunk)
            if body is not None:
                if on_written is not None:
                    on_written(chunk)
                yield sse(body)
            item = await anext(chunks, None)
        if builder.include_usage:
            yield sse(builder.usage_chunk())
    except APIError as e:  # after the headers: the error travels as an event
        yield sse(e.body())
    finally:
        await chunks.aclose()
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` that stops, and closes its body (so cancels the worker calls), as
    soon as the client disconnects, not only when a later write fails."""

    media_type = "text/event-stream"

    def __init__(self, content, cleanup: Callable[[], Awaitable[None]] | None = None, **kwargs) -> None:
        """``cleanup`` runs after the body, also when the body never started (a client that left
        between the first chunk and the response)."""
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        watch = asyncio.create_task(disconnected(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            result, _ = await asyncio.gather(stream, watch, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self._cleanup is not None:
                await self._cleanup()
        if isinstance(result, Exception) and not isinstance(result, OSError):
            raise result


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
