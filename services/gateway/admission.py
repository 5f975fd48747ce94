"""Bounded admission: at most ``limit`` generation requests in flight; past it, 429 at once.

A request holds its slot from its arrival until its response has ended: a stream until its last
event is sent or its client leaves, an error as soon as it is answered. The slot is taken before
the body is read, so that the limit also bounds the memory bodies take (``limit`` x the body limit).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from baton.services.gateway.errors import too_many_requests


class Admission:
    """A counter of slots. Not thread-safe: the event loop is its only user."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the concurrency limit must be at least 1, got {limit}")
        self.limit = limit
        self.in_flight = 0
        self._on_change = on_change

    def try_enter(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self._set(self.in_flight + 1)
        return True

    def leave(self) -> None:
        assert self.in_flight > 0, "left a slot never entered"
        self._set(self.in_flight - 1)

    def _set(self, value: int) -> None:
        self.in_flight = value
        if self._on_change is not None:
            self._on_change(value)


class AdmissionMiddleware:
    """Admits POSTs to ``paths`` through ``admission``; ``on_reject()`` counts the 429s."""

    def __init__(
        self,
        app,
        admission: Admission,
        paths: Collection[str],
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.admission = admission
        self.paths = frozenset(paths)
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if not self.admission.try_enter():
            if self.on_reject is not None:
                self.on_reject()
            await too_many_requests(self.admission.limit).response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()
