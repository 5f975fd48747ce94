"""Request bodies: a size limit enforced while they are read, and a strict, fast JSON parser.

``BodyLimitMiddleware`` reads the whole body before the app sees it, counting bytes, whether the
client declared a ``Content-Length`` or sent chunks; past the limit it answers 413 at once (a
declared length past it is refused before a byte is read). Starlette's own
``RequestBodyLimitMiddleware`` only checks as the app reads, and answers some cases in plain text,
not in OpenAI's shape.

``StrictJSONRoute`` parses JSON with pydantic-core (Rust): NaN and Infinity literals, which
Python's ``json`` accepts, are refused; so are lone surrogates and nesting deeper than 200, which
``json`` turns into strings the tokenizer and the JSON encoder then fail on, or a RecursionError.
It is also 2-3x faster than ``json.loads`` on long lists of token ids, which matters because a
parse holds the event loop: neither parser releases the GIL, so a worker thread would not free the
loop (measured: the loop stalled as long either way). The body limit is what bounds that stall.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute

from baton.services.gateway.errors import body_too_large

DRAIN_BYTES = 64 * 2**20
"""Before a 413, up to this much more of the body is read and dropped, so that a client still
sending it gets to read the answer."""
DRAIN_S = 5.0
"""The longest a 413 waits on draining."""


def declared_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware:
    """Bodies larger than ``max_bytes`` get a 413 in OpenAI's shape; ``on_reject()`` counts them."""

    def __init__(self, app, max_bytes: int, on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(scope, receive, send, more_coming=not _expects_continue(scope))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            more = message.get("more_body", False)
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, more_coming=more)
                return
            chunks.append(body)
            if not more:
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _reject(self, scope, receive, send, more_coming: bool) -> None:
        """Drain what the client is still sending (bounded), then answer 413: a server that
        answers and closes with the body unread resets the connection, and the client never
        reads the answer."""
        if self.on_reject is not None:
            self.on_reject()
        if more_coming:
            await _drain(receive)
        await body_too_large(self.max_bytes).response()(scope, receive, send)


def _expects_continue(scope) -> bool:
    """A client that sent ``Expect: 100-continue`` sends no body until told to: none to drain."""
    return any(n == b"expect" and v.lower() == b"100-continue" for n, v in scope["headers"])


async def _drain(receive) -> None:
    """Read and drop the rest of a body: at most ``DRAIN_BYTES``, for at most ``DRAIN_S``."""
    loop = asyncio.get_running_loop()
    left, deadline = DRAIN_BYTES, loop.time() + DRAIN_S
    while left > 0 and (wait := deadline - loop.time()) > 0:
        try:
            message = await asyncio.wait_for(receive(), wait)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        left -= len(message.get("body", b""))


def _replay(messages: list, receive):
    """A ``receive`` that gives ``messages`` first, then the client's own (its disconnect)."""
    pending = list(reversed(messages))

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def loads(body: bytes) -> Any:
    """Strict JSON: what FastAPI's handler reads as a ``JSONDecodeError`` (a 400) on bad input."""
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as e:
        hint = " (a lone surrogate such as \\ud800 is not Unicode)" if "hex escape" in str(e) else ""
        raise json.JSONDecodeError(f"{e}{hint}", "", 0) from None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by ``loads``."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
