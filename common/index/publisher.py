"""Publishes a worker's prefix-cache changes to the ``PrefixIndex`` off the engine's thread.

The engine thread hands over each step's ``CacheEvents`` (hashes stored and evicted) with
``submit``, which only enqueues; a background thread writes them to Redis, so a slow or absent
Redis never stalls a forward step.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class CachePublisher:
    def __init__(self, index: Any, worker_id: str) -> None:
        self._index = index
        self._worker_id = worker_id
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.published = 0

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name="baton-cache-publisher", daemon=True)
        self._thread.start()

    def submit(self, events: Any) -> None:
        """Queue one step's ``CacheEvents`` (``.stored`` and ``.removed`` hash lists)."""
        if events.stored or events.removed:
            self._queue.put(events)

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                # Evictions first: a hash evicted and stored again in one step stays published.
                if item.removed:
                    self._index.remove(self._worker_id, item.removed)
                if item.stored:
                    self._index.add(self._worker_id, item.stored)
                self.published += len(item.stored)
            except Exception:  # Redis away: routing loses a hint, serving goes on
                log.exception("publishing cache events failed")
