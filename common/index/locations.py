"""Block locations: request id -> the worker that receives its KV, the block ids there, and the
transfer's state. Records are Redis hashes with a TTL, so an abandoned transfer leaves nothing.

The records are for operators and tools, not for serving: a decode worker writes them through a
``LocationRecorder``, off the request's path, and a record lost while Redis is away is lost.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.common.index import keys
from baton.common.index._codec import as_text, ttl_ms
from baton.common.index.outage import OutageLog

log = logging.getLogger(__name__)

# Sets the state only on a record that still exists (an expired one must not come back as a
# fragment with a state and nothing else), and refreshes its TTL.
_UPDATE_STATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class BlockLocation:
    """Where one request's KV blocks live."""

    request_id: str
    worker_id: str
    """The worker whose KV pool holds (or will hold) the blocks."""
    block_ids: tuple[int, ...]
    """Block ids in that worker's pool, in prompt order."""
    state: str
    """Transfer state, e.g. ``"reserved"``, ``"transferring"``, ``"done"``, ``"failed"``."""


class BlockLocations:
    """Block-location records of one model under ``baton:<model>:loc:<request id>``, each living
    ``ttl_s`` after its last write. ``client`` is a ``redis.Redis``."""

    def __init__(self, client: Any, model: str, ttl_s: float) -> None:
        self._client = client
        self._model = model
        self._ttl_ms = ttl_ms(ttl_s)

    def put(self, request_id: str, worker_id: str, block_ids: Sequence[int], state: str) -> None:
        """Write (or replace) a request's record with a fresh TTL, atomically."""
        key = keys.location_key(self._model, request_id)
        fields = {
            "worker_id": worker_id,
            "block_ids": json.dumps([int(b) for b in block_ids]),
            "state": state,
        }
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, self._ttl_ms)
        pipe.execute()

    def get(self, request_id: str) -> BlockLocation | None:
        """A request's record, or None if absent or expired."""
        raw = self._client.hgetall(keys.location_key(self._model, request_id))
        if not raw:
            return None
        fields = {as_text(k): as_text(v) for k, v in raw.items()}
        return BlockLocation(
            request_id=request_id,
            worker_id=fields["worker_id"],
            block_ids=tuple(json.loads(fields["block_ids"])),
            state=fields["state"],
        )

    def update_state(self, request_id: str, state: str) -> bool:
        """Set the state of an existing record and refresh its TTL; False if there is none."""
        key = keys.location_key(self._model, request_id)
        return bool(self._client.eval(_UPDATE_STATE, 1, key, state, self._ttl_ms))

    def delete(self, request_id: str) -> bool:
        """Remove a record now; whether there was one."""
        return bool(self._client.delete(keys.location_key(self._model, request_id)))


class LocationRecorder:
    """Writes ``BlockLocations.put`` calls on a background thread, in order, so that no request
    waits on Redis. At most ``max_pending`` writes wait; past that (Redis slow or away) new ones
    are dropped and counted. ``start()`` / ``close()``."""

    def __init__(self, locations: BlockLocations, max_pending: int = 256) -> None:
        self._locations = locations
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._outage = OutageLog(log, "block locations")
        self.num_dropped = 0

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("recorder already started")
        self._thread = threading.Thread(target=self._run, name="baton-block-locations", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Writes queued, not yet done."""
        return self._queue.qsize()

    def record(self, request_id: str, worker_id: str, block_ids: Sequence[int], state: str) -> None:
        """Queue one record (never blocks)."""
        try:
            self._queue.put_nowait((request_id, worker_id, list(block_ids), state))
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued (bounded by ``timeout_s``), then end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return  # the thread is stuck on a Redis that is away; it is a daemon
        thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._locations.put(*item)
            except Exception as e:  # noqa: BLE001 - Redis away: the record is lost, nothing else
                self.num_dropped += 1
                self._outage.failed(e)
            else:
                self._outage.ok()
