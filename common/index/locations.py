"""Block locations: request id -> the worker that receives its KV, the block ids there, and the
transfer's state. Records are Redis hashes with a TTL, so an abandoned transfer leaves nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.common.index import keys
from baton.common.index._codec import as_text, ttl_ms

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
