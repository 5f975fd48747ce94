"""A pool of fixed-size KV blocks with ref counts, a prefix cache and LRU eviction. No torch.

Every block is in exactly one state:
  * in use   — ``ref_cnt > 0``; not in the free queue;
  * free     — ``ref_cnt == 0``; in the free queue, oldest-freed first. A free block may still hold
               a cached prefix (``block_hash`` set): it can be revived by a prefix hit until the
               queue hands it out, at which point its hash is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from baton.common.engine.hashing import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class CacheEvents:
    """Hashes that became cached or were evicted since the last ``take_events`` (for the index)."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block; insertion order is the eviction order (least recently freed first).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events = CacheEvents()

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds, free blocks' included (what a worker publishes)."""
        return list(self._cached)

    # -- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting any prefix they cached."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given; unreferenced blocks join the
        tail of the free queue, so callers pass a request's blocks tail first: its last blocks
        are the least likely to be shared, and are evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache --------------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the full block named ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another block already holds these tokens (computed concurrently); keep the first.
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._events.stored.append(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self._events.removed.append(block.block_hash)
        block.block_hash = None

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the prefixes these blocks hold (evict events included): their KV is suspect, e.g.
        a failed step was writing it, so no later prompt may hit it. Ref counts are unchanged."""
        for block_id in block_ids:
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def take_events(self) -> CacheEvents:
        events, self._events = self._events, CacheEvents()
        return events

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's books do not balance."""
        assert len(self.blocks) == self.num_blocks
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free_queue={in_free}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the cache does not map to it"
                )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"cache maps a hash to block {block.block_id}"
        assert all(self._free[i].block_id == i for i in self._free)
