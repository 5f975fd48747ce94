"""Publishes a worker's prefix-cache changes to the ``PrefixIndex`` off the engine's thread.

The engine thread hands over each step's ``CacheEvents`` (hashes stored and evicted) with
``submit``, which only enqueues; a background thread writes them to Redis, so a slow or absent
Redis never stalls a forward step.

Redis can go away. A write that fails drops its events and everything queued behind it (the
queue must not grow while Redis is away, and the events are replaced below), and the index now
misses what this worker caches. Once Redis answers again, or when the heartbeat finds that Redis
restarted empty, ``resync()`` asks the engine for every hash its prefix cache still holds
(``snapshot_source``, run on the engine thread so that the snapshot sits in the queue in order
with the step events around it) and publishes them all again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from baton.common.index.outage import OutageLog

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class _Snapshot:
    """Every hash the prefix cache held at one moment (published again after an outage)."""

    hashes: Sequence[bytes]


class CachePublisher:
    def __init__(
        self,
        index: Any,
        worker_id: str,
        batch_size: int = 512,
        probe_s: float = 1.0,
    ) -> None:
        """``index`` is a ``PrefixIndex``; a snapshot goes out ``batch_size`` hashes per round trip;
        after lost events the thread probes Redis every ``probe_s`` while nothing else is queued,
        so that an idle worker also catches up when Redis returns."""
        self._index = index
        self._worker_id = worker_id
        self._batch_size = batch_size
        self._probe_s = probe_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outage = OutageLog(log, "prefix index (cache publisher)")
        self._lost = False
        self._resync_lock = threading.Lock()
        self._resync_pending = False
        self.snapshot_source: Callable[[], None] | None = None
        """Asks the engine thread to call ``submit_snapshot`` with every cached hash; set by the
        worker once its engine runs. None: lost events stay lost (they fade by TTL)."""
        self.published = 0
        self.num_dropped = 0
        """Step events dropped because Redis was away."""
        self.num_resyncs = 0
        """Snapshots published whole (after an outage or a Redis that came back empty)."""

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(target=self._run, name="baton-cache-publisher", daemon=True)
        self._thread.start()

    def submit(self, events: Any) -> None:
        """Queue one step's ``CacheEvents`` (``.stored`` and ``.removed`` hash lists)."""
        if events.stored or events.removed:
            self._queue.put(events)

    def submit_snapshot(self, hashes: Sequence[bytes]) -> None:
        """Queue every hash the prefix cache holds now (the engine thread calls it for ``resync``)."""
        self._queue.put(_Snapshot(list(hashes)))

    def resync(self) -> None:
        """Publish the whole prefix cache again, soon (any thread; one pending request at a time)."""
        source = self.snapshot_source
        if source is None:
            return
        with self._resync_lock:
            if self._resync_pending:
                return
            self._resync_pending = True
        source()

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._probe_s) if self._lost else self._queue.get()
            except queue.Empty:
                item = None  # nothing to publish: see whether Redis is back
            if item is _STOP:
                return
            try:
                self._publish(item)
            except Exception as e:  # noqa: BLE001 - Redis away: routing loses hints, serving goes on
                self._outage.failed(e)
                self._lose(item)
                continue
            self._outage.ok()
            if self._lost:  # Redis answers again: catch up on what was dropped
                if self.snapshot_source is None:
                    self._lost = False
                self.resync()

    def _publish(self, item: Any) -> None:
        if item is None:
            self._index.ping()
            return
        if isinstance(item, _Snapshot):
            with self._resync_lock:
                self._resync_pending = False
            for i in range(0, len(item.hashes), self._batch_size):
                self._index.add(self._worker_id, item.hashes[i : i + self._batch_size])
            self._lost = False
            self.num_resyncs += 1
            self.published += len(item.hashes)
            return
        # Evictions first: a hash evicted and stored again in one step stays published.
        if item.removed:
            self._index.remove(self._worker_id, item.removed)
        if item.stored:
            self._index.add(self._worker_id, item.stored)
        self.published += len(item.stored)

    def _lose(self, failed: Any) -> None:
        """Drop the item that failed and everything queued behind it (a snapshot replaces them);
        keep a stop request."""
        self._lost = True
        stop = False
        item = failed
        while True:
            if item is _STOP:
                stop = True
            elif isinstance(item, _Snapshot):
                with self._resync_lock:
                    self._resync_pending = False
            elif item is not None:
                self.num_dropped += 1
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        if stop:
            self._queue.put(_STOP)
