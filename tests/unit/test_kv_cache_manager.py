"""KVCacheManager with block_size 4 and tiny pools: prefix hits, slot allocation, release order."""

from __future__ import annotations

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.request import Request
from baton.common.engine.sampling_params import SamplingParams

BS = 4
PROMPT = [100 + i for i in range(12)]  # three full blocks


def make(num_blocks: int, enable_caching: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, enable_caching=enable_caching)
    return pool, KVCacheManager(pool, BlockHasher(BS))


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def prefill(kv: KVCacheManager, r: Request) -> None:
    """Allocate and 'compute' the whole prompt, as a scheduler step would (no prefix hit)."""
    assert kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = r.num_tokens


def test_nothing_cached_means_no_hit():
    _, kv = make(4)
    assert kv.get_computed_blocks(req("a", PROMPT)) == ([], 0)


def test_fully_cached_prompt_leaves_its_last_block_to_compute():
    pool, kv = make(6)
    prefill(kv, req("a", PROMPT[:8]))
    assert kv.block_ids("a") == [0, 1]
    # Both blocks of the 8-token prompt are cached, but the hit stops one block short so that
    # the step computing the prompt's last token yields logits.
    blocks, n = kv.get_computed_blocks(req("b", PROMPT[:8]))
    assert (ids(blocks), n) == ([0], 4)
    blocks, n = kv.get_computed_blocks(req("c", PROMPT[:8] + [7]))
    assert (ids(blocks), n) == ([0, 1], 8)
    blocks, n = kv.get_computed_blocks(req("d", PROMPT[:7]))
    assert (ids(blocks), n) == ([0], 4)
    blocks, n = kv.get_computed_blocks(req("e", PROMPT[:4]))
    assert (ids(blocks), n) == ([], 0)
    # A lookup takes no references.
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 0, 0, 0, 0]


def test_hit_stops_at_the_first_differing_block():
    _, kv = make(6)
    prefill(kv, req("a", PROMPT))
    other = PROMPT[:4] + [1] + PROMPT[5:] + [9]
    blocks, n = kv.get_computed_blocks(req("b", other))
    assert (ids(blocks), n) == ([0], 4)
    blocks, n = kv.get_computed_blocks(req("c", [1] + PROMPT[1:] + [9]))
    assert (ids(blocks), n) == ([], 0)


def test_shared_prefix_second_request_uses_the_first_requests_blocks():
    pool, kv = make(6)
    a = req("a", PROMPT[:10])
    prefill(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    b = req("b", PROMPT[:8] + [200, 201, 202])
    hit, n = kv.get_computed_blocks(b)
    assert (ids(hit), n) == ([0, 1], 8)
    assert kv.allocate_slots(b, b.num_tokens - n, hit)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in pool.blocks] == [2, 2, 1, 1, 0, 0]
    assert pool.num_free_blocks == 2
    pool.check_integrity()
    # Releasing one owner keeps the shared blocks in use.
    kv.free(a)
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 0, 1, 0, 0]
    kv.free(b)
    assert pool.num_free_blocks == 6
    # Free order: never-used 4, 5; then a's tail 2; then b's tail first: 3, 1, 0.
    assert ids(pool.get_new_blocks(6)) == [4, 5, 2, 3, 1, 0]


def test_hit_on_free_cached_blocks_revives_them():
    pool, kv = make(4)
    a = req("a", PROMPT)
    prefill(kv, a)
    kv.free(a)
    assert pool.num_free_blocks == 4
    b = req("b", PROMPT[:8] + [7, 7])
    hit, n = kv.get_computed_blocks(b)
    assert (ids(hit), n) == ([0, 1], 8)
    assert kv.allocate_slots(b, 2, hit)
    # 0 and 1 are revived; the new block is the head of the free queue (never-used 3).
    assert kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 0, 1]
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_allocate_failure_changes_nothing():
    pool, kv = make(4)
    prefill(kv, req("a", PROMPT))
    assert pool.num_free_blocks == 1
    b = req("b", [1] * 8)
    assert kv.allocate_slots(b, 8) is False
    assert pool.num_free_blocks == 1
    assert kv.block_ids("b") == []
    assert [blk.ref_cnt for blk in pool.blocks] == [1, 1, 1, 0]
    pool.check_integrity()
    # The pool can still serve a request that fits.
    c = req("c", [1] * 4)
    assert kv.allocate_slots(c, 4)
    assert kv.block_ids("c") == [3]


def test_allocate_failure_with_prefix_hit_counts_revived_blocks_and_changes_nothing():
    pool, kv = make(3)
    a = req("a", PROMPT[:9])
    prefill(kv, a)  # blocks 0, 1 cached; block 2 partial
    kv.free(a)
    # 13 tokens: hit 8 on the free cached blocks 0 and 1, needs 2 more blocks, but reviving 0
    # and 1 leaves only block 2.
    b = req("b", PROMPT[:8] + [50, 51, 52, 53, 54])
    hit, n = kv.get_computed_blocks(b)
    assert (ids(hit), n) == ([0, 1], 8)
    assert kv.allocate_slots(b, 5, hit) is False
    assert pool.num_free_blocks == 3
    assert [blk.ref_cnt for blk in pool.blocks] == [0, 0, 0]
    assert kv.block_ids("b") == []
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    assert pool.get_cached_block(a.block_hashes[1]) is pool.blocks[1]
    pool.check_integrity()
    # One token fewer fits exactly.
    c = req("c", PROMPT[:8] + [50, 51, 52, 53])
    hit, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 4, hit)
    assert kv.block_ids("c") == [0, 1, 2]
    assert pool.num_free_blocks == 0


def test_running_request_that_cannot_grow_keeps_its_blocks():
    pool, kv = make(1)
    r = req("r", PROMPT[:4])
    prefill(kv, r)
    r.append_output(5)
    assert kv.allocate_slots(r, 1) is False
    assert kv.block_ids("r") == [0]
    assert pool.blocks[0].ref_cnt == 1
    pool.check_integrity()


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    pool, kv = make(3)
    a = req("a", PROMPT)
    prefill(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.free(a)
    assert kv.block_ids("a") == []
    pool.take_events()
    x = req("x", [1, 1, 1, 1])
    assert kv.allocate_slots(x, 4)
    assert kv.block_ids("x") == [2]
    assert pool.take_events().removed == [a.block_hashes[2]]
    assert pool.get_cached_block(a.block_hashes[2]) is None
    # The head of the prefix survives.
    hit, n = kv.get_computed_blocks(req("a2", PROMPT))
    assert (ids(hit), n) == ([0, 1], 8)


def test_decode_grows_one_block_at_a_boundary_and_caches_blocks_as_they_fill():
    pool, kv = make(4)
    r = req("r", PROMPT[:6])
    prefill(kv, r)
    assert kv.block_ids("r") == [0, 1]
    assert pool.take_events().stored == r.block_hashes[:1]
    for step, tok in enumerate([7, 8, 9]):
        r.append_output(tok)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        if step == 0:  # 7 tokens: block 1 not yet full
            assert kv.block_ids("r") == [0, 1]
            assert pool.take_events().stored == []
        elif step == 1:  # 8 tokens: block 1 full, cached
            assert kv.block_ids("r") == [0, 1]
            assert pool.take_events().stored == [r.block_hashes[1]]
            assert pool.blocks[1].block_hash == r.block_hashes[1]
        else:  # 9 tokens: a third block
            assert kv.block_ids("r") == [0, 1, 2]
            assert pool.take_events().stored == []
    assert r.block_hashes == BlockHasher(BS).hash_blocks(r.all_token_ids)
    pool.check_integrity()


def test_caching_disabled_never_hits():
    pool, kv = make(4, enable_caching=False)
    prefill(kv, req("a", PROMPT[:8]))
    assert kv.get_computed_blocks(req("b", PROMPT[:8] + [1])) == ([], 0)
    assert all(b.block_hash is None for b in pool.blocks)


def _reserve(kv: KVCacheManager, r: Request) -> None:
    """Blocks for the whole prompt, not cached: a remote prefill fills them (``reserve_remote``)."""
    assert kv.allocate_slots(r, r.num_tokens, cache=False)


def test_quarantined_blocks_stay_out_of_the_pool_until_settled_whoever_frees_them():
    pool, kv = make(5)
    r = req("r", PROMPT)
    _reserve(kv, r)
    assert kv.block_ids("r") == [0, 1, 2]
    settled = [False]
    kv.quarantine([1, 2], lambda: settled[0])  # a message is still being written into 1 and 2
    assert [b.ref_cnt for b in pool.blocks] == [1, 2, 2, 0, 0]
    kv.free(r)  # e.g. the request was aborted meanwhile
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 1, 0, 0]
    assert pool.num_free_blocks == 3 and kv.num_quarantined_blocks == 2
    assert kv.release_settled() == 0
    settled[0] = True
    assert kv.release_settled() == 2
    assert kv.num_quarantined_blocks == 0
    pool.check_integrity()
    assert ids(pool.get_new_blocks(5)) == [3, 4, 0, 2, 1]  # they join the free queue last, tail first


def test_a_request_swaps_its_quarantined_blocks_for_fresh_ones_in_place():
    pool, kv = make(6)
    r = req("r", PROMPT)
    _reserve(kv, r)
    r.num_computed_tokens = 4
    kv.cache_computed(r, 4)  # block 0 landed and is kept; 1 is being written, 2 never was
    kv.quarantine([1], lambda: False)
    assert kv.swap_quarantined(r)
    assert kv.block_ids("r") == [0, 3, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 0, 0]  # 1: the quarantine's only
    assert pool.blocks[0].block_hash == r.block_hashes[0]
    assert kv.swap_quarantined(r)  # nothing of it is quarantined any more: nothing changes
    assert kv.block_ids("r") == [0, 3, 2]
    pool.check_integrity()


def test_a_swap_without_room_changes_nothing():
    pool, kv = make(3)
    r = req("r", PROMPT)
    _reserve(kv, r)
    kv.quarantine([1, 2], lambda: False)
    assert not kv.swap_quarantined(r)
    assert kv.block_ids("r") == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 2, 2]
    pool.check_integrity()


def test_quarantined_blocks_leave_the_prefix_cache():
    pool, kv = make(4)
    prefill(kv, req("a", PROMPT[:8]))
    kv.quarantine([1], lambda: True)
    assert pool.blocks[1].block_hash is None
    assert ids(kv.get_computed_blocks(req("b", PROMPT[:8] + [5]))[0]) == [0]
    kv.release_settled()
    pool.check_integrity()


def test_the_cached_prefix_estimate_agrees_with_the_lookup_and_counts_nothing():
    _, kv = make(8)
    prefill(kv, req("a", PROMPT))
    prompts = [PROMPT[:8], PROMPT[:8] + [7], PROMPT + [1, 2], PROMPT[:4] + [1] + PROMPT[5:], [5] * 9, []]
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    estimates = [kv.cached_prefix_tokens(p) for p in prompts]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (queries, hits)
    assert estimates == [kv.get_computed_blocks(req(f"q{i}", p))[1] for i, p in enumerate(prompts)]
    assert estimates == [4, 8, 12, 4, 0, 0]
    _, off = make(8, enable_caching=False)
    assert off.cached_prefix_tokens(PROMPT + [1]) == 0
