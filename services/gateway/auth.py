"""API keys: with keys set, every ``/v1/*`` call and ``/workers`` need ``Authorization: Bearer
<key>``; ``/health``, ``/ready``, ``/metrics`` and the API's docs stay open (probes and scrapers
carry no keys, and none of them shows a worker's address or runs the model).

Keys are compared in constant time and never logged: a 401 says only that the key is missing or
wrong.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence

from baton.services.gateway.errors import unauthorized


def is_protected(path: str) -> bool:
    return path == "/workers" or path == "/v1" or path.startswith("/v1/")


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class KeyCheck:
    """Whether a token is one of the keys. Every key is compared, each in constant time, so the
    time taken says nothing about which key came close."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("API keys must be non-empty")
        self._keys = tuple(k.encode() for k in keys)

    def allows(self, token: bytes | None) -> bool:
        if token is None:
            return False
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(token, key)
        return found


class APIKeyMiddleware:
    """401 in OpenAI's shape (with ``WWW-Authenticate: Bearer``) for a protected path without a
    valid key; ``on_reject()`` counts them."""

    def __init__(self, app, keys: Sequence[str], on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.check = KeyCheck(keys)
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            if not self.check.allows(bearer_token(scope["headers"])):
                if self.on_reject is not None:
                    self.on_reject()
                await unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
