"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and release. No torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from baton.common.engine.block_pool import BlockPool, KVBlock
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, hasher: BlockHasher):
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # request -> how many of its blocks are registered
        # Prefix-cache lookups in tokens, as vLLM counts them (for metrics).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._quarantined: list[tuple[list[KVBlock], Callable[[], bool]]] = []
        """Blocks that something outside the engine may still write, each group with the test that
        says it no longer can (``quarantine``)."""

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Make ``req.block_hashes`` cover the full blocks of its first ``num_tokens`` tokens."""
        have = len(req.block_hashes)
        if num_tokens // self.block_size > have:
            parent = req.block_hashes[-1] if have else None
            req.block_hashes.extend(
                self.hasher.hash_blocks(req.all_token_ids[:num_tokens], parent=parent, start_block=have)
            )

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``req`` as blocks and a token count.

        At least one token is always left to compute, so that the step that finishes the prompt
        produces logits to sample from: a fully cached prompt hits all but its last block.
        """
        if not self.pool.enable_caching:
            return [], 0
        self._extend_hashes(req, req.num_tokens)
        hit = self._cached_run(req.block_hashes[: (req.num_tokens - 1) // self.block_size])
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of a prompt the prefix cache holds now, as ``get_computed_blocks``
        would find them, without counting a lookup or touching a request: a load estimate that
        another thread may take while the engine runs (the answer can be a step stale)."""
        if not self.pool.enable_caching:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self.hasher.hash_blocks(token_ids[: max_blocks * self.block_size])
        return len(self._cached_run(hashes)) * self.block_size

    def _cached_run(self, hashes) -> list[KVBlock]:
        """The cached blocks of ``hashes`` up to the first one the cache lacks."""
        hit: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        cache: bool = True,
    ) -> bool:
        """Reserve blocks so that ``num_new_tokens`` more tokens fit after the computed ones.

        ``new_computed_blocks`` are prefix hits not yet owned by the request. Returns False and
        changes nothing if the pool cannot supply the blocks. ``cache=False`` reserves blocks whose
        content arrives later (a remote prefill): they join the prefix cache only once
        ``cache_computed`` says their tokens are in place.
        """
        computed = new_computed_blocks or []
        owned = self._blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(owned) - len(computed)
        # Reviving a free cached block takes it out of the free queue too.
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - revived:
            if not owned:
                del self._blocks[req.request_id]
            return False
        self.pool.touch(computed)
        owned.extend(computed)
        if needed > 0:
            owned.extend(self.pool.get_new_blocks(needed))
        if cache:
            self._cache_full_blocks(req, owned, total)
        return True

    def cache_computed(self, req: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_tokens`` tokens are in place."""
        self._cache_full_blocks(req, self._blocks.get(req.request_id, []), num_tokens)

    def _cache_full_blocks(self, req: Request, owned: list[KVBlock], num_tokens: int) -> None:
        """Register the blocks that are full once ``num_tokens`` tokens are computed."""
        if not self.pool.enable_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_cached.get(req.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(req, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(owned[i], req.block_hashes[i])
        self._num_cached[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (see ``BlockPool.free_blocks``)."""
        blocks = self._blocks.pop(req.request_id, [])
        self._num_cached.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past the ones ``num_tokens`` tokens fill, tail first: after a
        verification, blocks that held only rejected proposals. They were reserved with
        ``cache=False`` and never registered, so no prefix hit can find their contents."""
        owned = self._blocks.get(req.request_id)
        if not owned:
            return
        keep = -(-num_tokens // self.block_size)
        extra = owned[keep:]
        del owned[keep:]
        self.pool.free_blocks(reversed(extra))

    # -- quarantine ------------------------------------------------------------------------------
    def quarantine(self, block_ids: Iterable[int], settled: Callable[[], bool]) -> None:
        """Keep blocks out of the pool until ``settled()`` (any thread may make it true): a receive
        that the transport could not cancel may still write them (a remote prefill given up
        mid-message). The quarantine holds one reference on each; whoever else holds them may let
        go as usual. Their contents are suspect, so they leave the prefix cache."""
        ids = list(block_ids)
        if not ids:
            return
        blocks = [self.pool.blocks[i] for i in ids]
        self.pool.uncache_blocks(ids)
        self.pool.touch(blocks)
        self._quarantined.append((blocks, settled))

    def release_settled(self) -> int:
        """Give back the quarantined blocks nothing can write any more; how many went back."""
        released, kept = 0, []
        for blocks, settled in self._quarantined:
            if settled():
                self.pool.free_blocks(reversed(blocks))
                released += len(blocks)
            else:
                kept.append((blocks, settled))
        self._quarantined = kept
        return released

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(blocks) for blocks, _ in self._quarantined)

    def swap_quarantined(self, req: Request) -> bool:
        """Give ``req`` fresh blocks in place of its quarantined ones (past its registered prefix),
        letting go of those; False, changing nothing, when the pool cannot supply them."""
        owned = self._blocks.get(req.request_id, [])
        suspect = {b.block_id for blocks, _ in self._quarantined for b in blocks}
        slots = [i for i, b in enumerate(owned) if b.block_id in suspect]
        if not slots:
            return True
        assert slots[0] >= self._num_cached.get(req.request_id, 0), (
            "a quarantined block is in the prefix cache"
        )
        if len(slots) > self.pool.num_free_blocks:
            return False
        old = [owned[i] for i in slots]
        for i, block in zip(slots, self.pool.get_new_blocks(len(slots))):
            owned[i] = block
        self.pool.free_blocks(reversed(old))
        return True
