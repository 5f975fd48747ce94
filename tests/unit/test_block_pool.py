"""BlockPool: tiny pools, exact block ids, LRU reuse, ref counts, prefix cache and its events."""

from __future__ import annotations

import random

import pytest

from baton.common.engine.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.num_free_blocks == 0
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1]
    assert pool.usage == 1.0
    pool.check_integrity()


def test_reuse_follows_free_order_least_recently_freed_first():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks([blocks[3]])
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[4]])
    assert pool.num_free_blocks == 3
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    pool.free_blocks([blocks[0]])
    assert ids(pool.get_new_blocks(2)) == [4, 0]
    pool.check_integrity()


def test_free_blocks_enqueues_in_the_order_given():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert ids(pool.get_new_blocks(4)) == [2, 0, 3, 1]


def test_never_used_blocks_come_before_freed_ones():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # 0, 1; 2 and 3 still free
    pool.free_blocks(reversed(a))
    assert ids(pool.get_new_blocks(4)) == [2, 3, 1, 0]


def test_ref_counts_with_touch_and_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert (b.block_id, b.ref_cnt) == (0, 1)
    pool.touch([b])
    assert b.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert pool.num_free_blocks == 3  # still referenced: not free
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    pool.check_integrity()


def test_freed_cached_block_is_revived_by_prefix_hit_and_not_handed_out():
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, h(7))
    pool.free_blocks([b0])
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(h(7))
    assert hit is b0 and hit.ref_cnt == 0
    pool.touch([hit])
    assert b0.ref_cnt == 1 and b0.block_hash == h(7)
    assert pool.num_free_blocks == 2
    assert ids(pool.get_new_blocks(2)) == [2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(h(7)) is b0  # revived, so never evicted
    pool.check_integrity()


def test_handing_out_a_free_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, h(1))
    pool.cache_block(b1, h(2))
    events = pool.take_events()
    assert events.stored == [h(1), h(2)] and events.removed == []
    pool.free_blocks([b1, b0])
    assert pool.get_cached_block(h(1)) is b0  # free but still cached
    (got,) = pool.get_new_blocks(1)
    assert got is b1
    assert pool.get_cached_block(h(2)) is None
    assert b1.block_hash is None
    assert pool.get_cached_block(h(1)) is b0
    events = pool.take_events()
    assert events.stored == [] and events.removed == [h(2)]
    assert pool.take_events().removed == []  # taken once
    pool.check_integrity()


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3)
    b0, b1, _ = pool.get_new_blocks(3)
    pool.cache_block(b0, h(5))
    pool.cache_block(b1, h(5))
    assert pool.get_cached_block(h(5)) is b0
    assert b1.block_hash is None
    assert pool.take_events().stored == [h(5)]
    # Evicting the loser must not remove the winner's entry.
    pool.free_blocks([b1])
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_cached_block(h(5)) is b0
    assert pool.take_events().removed == []
    pool.check_integrity()


def test_cache_block_does_not_rename_a_cached_block():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, h(1))
    pool.cache_block(b0, h(2))
    assert b0.block_hash == h(1)
    assert pool.get_cached_block(h(2)) is None
    assert pool.take_events().stored == [h(1)]


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, h(1))
    assert b0.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.take_events().stored == []


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.get_new_blocks(1)) == [3]
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free_blocks([pool.blocks[2]])
    pool.check_integrity()


def test_zero_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_reset_prefix_cache_refused_while_in_use_then_evicts_all():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, h(1))
    pool.cache_block(b1, h(2))
    pool.take_events()
    pool.free_blocks([b1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is b0 and pool.get_cached_block(h(2)) is b1
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None and pool.get_cached_block(h(2)) is None
    assert sorted(pool.take_events().removed) == [h(1), h(2)]
    assert pool.num_free_blocks == 3
    pool.check_integrity()


class _ModelPool:
    """A reference model of the pool's documented behaviour, kept by hand."""

    def __init__(self, n: int):
        self.free = list(range(n))  # head is handed out first
        self.ref = [0] * n
        self.hash_of: list[bytes | None] = [None] * n
        self.cached: dict[bytes, int] = {}
        self.stored: list[bytes] = []
        self.removed: list[bytes] = []

    def allocate(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        for b in out:
            hb = self.hash_of[b]
            if hb is not None:
                if self.cached.get(hb) == b:
                    del self.cached[hb]
                    self.removed.append(hb)
                self.hash_of[b] = None
            self.ref[b] = 1
        return out

    def touch(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)

    def cache(self, b: int, hb: bytes) -> None:
        if self.hash_of[b] is not None or hb in self.cached:
            return
        self.hash_of[b] = hb
        self.cached[hb] = b
        self.stored.append(hb)


def test_random_operations_match_reference_model_and_keep_integrity():
    rng = random.Random(1234)
    n = 6
    pool, model = BlockPool(n), _ModelPool(n)
    held: list[int] = []  # one entry per reference this test holds
    counts = {"alloc": 0, "overalloc": 0, "touch": 0, "free": 0, "cache": 0, "evicted": 0}
    for _ in range(5000):
        op = rng.random()
        if op < 0.3:
            k = rng.randint(1, 3)
            if k > len(model.free):
                with pytest.raises(ValueError):
                    pool.get_new_blocks(k)
                counts["overalloc"] += 1
            else:
                before = len(model.removed)
                got = ids(pool.get_new_blocks(k))
                assert got == model.allocate(k)
                counts["evicted"] += len(model.removed) - before
                counts["alloc"] += 1
                held.extend(got)
        elif op < 0.5 and model.cached:
            hb = rng.choice(sorted(model.cached))
            block = pool.get_cached_block(hb)
            assert block is not None and block.block_id == model.cached[hb]
            pool.touch([block])
            model.touch(block.block_id)
            held.append(block.block_id)
            counts["touch"] += 1
        elif op < 0.8 and held:
            k = rng.randint(1, min(3, len(held)))
            picked = [held.pop(rng.randrange(len(held))) for _ in range(k)]
            pool.free_blocks([pool.blocks[b] for b in picked])
            for b in picked:
                model.release(b)
            counts["free"] += 1
        elif held:
            b = rng.choice(held)
            hb = h(rng.randrange(12))  # few names, so collisions with other blocks happen
            pool.cache_block(pool.blocks[b], hb)
            model.cache(b, hb)
            counts["cache"] += 1
        pool.check_integrity()
        assert [blk.ref_cnt for blk in pool.blocks] == model.ref
        assert [blk.block_hash for blk in pool.blocks] == model.hash_of
        assert pool.num_free_blocks == len(model.free)
        for hb, b in model.cached.items():
            assert pool.get_cached_block(hb) is pool.blocks[b]
    events = pool.take_events()
    assert events.stored == model.stored
    assert events.removed == model.removed
    # The sequence exercised every branch, not just the easy ones.
    assert min(counts.values()) > 50, counts
    # Drain: free every reference; the pool ends fully free and consistent.
    pool.free_blocks([pool.blocks[b] for b in held])
    assert pool.num_free_blocks == n
    pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt",
    [
        "free_block_gets_a_ref",
        "used_block_loses_its_ref",
        "negative_ref",
        "hash_not_in_cache",
        "cache_points_at_wrong_block",
    ],
)
def test_check_integrity_detects_corruption(corrupt):
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, h(1))
    pool.cache_block(b1, h(2))
    pool.check_integrity()
    if corrupt == "free_block_gets_a_ref":
        pool.blocks[3].ref_cnt = 1
    elif corrupt == "used_block_loses_its_ref":
        b1.ref_cnt = 0
    elif corrupt == "negative_ref":
        pool.free_blocks([b0])
        b0.ref_cnt = -1
    elif corrupt == "hash_not_in_cache":
        pool.blocks[2].block_hash = h(9)
    elif corrupt == "cache_points_at_wrong_block":
        b1.block_hash = h(1)
    with pytest.raises(AssertionError):
        pool.check_integrity()
