"""Prefix index: block hash -> the workers that cache that block, for cache-aware routing.

Each block hash has a Redis set of worker ids, ``baton:<model>:prefix:<hex>``, written when a
worker caches the block and trimmed when it evicts it. Two things keep the index bounded:

- every set has a TTL, refreshed on each add, so entries nobody re-publishes fade out;
- a sorted set ``baton:<model>:prefix-lru`` scores each hash by its last add time; past
  ``max_entries`` the oldest hashes are dropped together with their sets.

Within one ``add`` the chain's earlier blocks get the newer scores: a chain is only useful from its
first block on, so when the bound bites, tails go before heads.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.common.index import keys
from baton.common.index._codec import as_text, ttl_ms

# Drops the LRU entries whose sets have expired, then the oldest past the bound, with their sets.
# KEYS[1] = the LRU sorted set; ARGV = key head, max entries, expiry cutoff (scores below it are stale).
_TRIM = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[2])
if over <= 0 then return 0 end
local old = redis.call('ZRANGE', KEYS[1], 0, over - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
for _, member in ipairs(old) do redis.call('DEL', ARGV[1] .. member) end
return over
"""

# Removes one worker from each block's set; a set left empty (Redis deletes it) leaves the LRU too.
# KEYS[1] = the LRU sorted set, KEYS[2..] = the block sets; ARGV[1] = worker, ARGV[2..] = LRU members.
_REMOVE = """
local removed = 0
for i = 2, #KEYS do
  removed = removed + redis.call('SREM', KEYS[i], ARGV[1])
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return removed
"""

# Score step between consecutive blocks of one add (seconds); small against the time between adds.
_CHAIN_STEP_S = 1e-6


@dataclass(frozen=True)
class PrefixIndexConfig:
    max_entries: int = 1_000_000
    """Most block hashes kept per model; the least recently added go first."""
    ttl_s: float = 3600.0
    """Lifetime of a block's entry after its last add."""


class PrefixIndex:
    """Which workers of one model cache which blocks, by chained block hash.

    ``client`` is a ``redis.Redis`` (either ``decode_responses`` setting works). Every call is one
    round trip. Writers are workers (``add`` on cache, ``remove`` on evict); the reader is the
    router (``longest_prefix``).
    """

    def __init__(self, client: Any, model: str, max_entries: int, ttl_s: float = 3600.0) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._client = client
        self._model = model
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._ttl_ms = ttl_ms(ttl_s)
        self._lru = keys.prefix_lru_key(model)
        self._head = keys.prefix_key_head(model)

    @classmethod
    def from_config(cls, client: Any, model: str, config: PrefixIndexConfig) -> PrefixIndex:
        return cls(client, model, config.max_entries, config.ttl_s)

    def add(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """Record that ``worker_id`` caches the blocks ``hashes`` (a chain, first block first)."""
        if not hashes:
            return
        members = [keys.prefix_member(h) for h in hashes]
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        for member in members:
            pipe.sadd(self._head + member, worker_id)
            pipe.pexpire(self._head + member, self._ttl_ms)
        pipe.zadd(self._lru, {m: now - i * _CHAIN_STEP_S for i, m in enumerate(members)})
        pipe.pexpire(self._lru, self._ttl_ms)
        pipe.eval(_TRIM, 1, self._lru, self._head, self._max_entries, repr(now - self._ttl_s))
        pipe.execute()

    def remove(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """Record that ``worker_id`` evicted the blocks ``hashes``; how many entries it had."""
        if not hashes:
            return 0
        members = [keys.prefix_member(h) for h in hashes]
        block_keys = [self._head + m for m in members]
        return int(
            self._client.eval(_REMOVE, 1 + len(block_keys), self._lru, *block_keys, worker_id, *members)
        )

    def forget_worker(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """Drop everything ``worker_id`` published under ``hashes`` (a worker that restarts with an
        empty cache, or one that shuts down). Entries it published elsewhere fade by TTL."""
        return self.remove(worker_id, hashes)

    def longest_prefix(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each worker, how many leading blocks of the chain ``hashes`` it caches.

        Counting stops at a worker's first missing block: holding block 3 without block 2 is no
        use, since KV is only valid after its whole prefix. Workers that miss block 0 are absent.
        """
        if not hashes:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(keys.prefix_key(self._model, h))
        return chain_lengths([{as_text(w) for w in ws} for ws in pipe.execute()])

    def ping(self) -> None:
        """One round trip to Redis (raises if it is away)."""
        self._client.ping()

    def num_entries(self) -> int:
        """How many block hashes the bound currently counts."""
        return int(self._client.zcard(self._lru))


def chain_lengths(holders: Sequence[set[str]]) -> dict[str, int]:
    """Per worker, the length of the run of leading blocks it holds; ``holders[i]`` holds block i."""
    lengths: dict[str, int] = {}
    alive = set(holders[0]) if holders else set()
    for i, block_holders in enumerate(holders):
        alive &= block_holders
        if not alive:
            break
        for worker in alive:
            lengths[worker] = i + 1
    return lengths
