"""Prefix index against a real Redis: chain semantics, evict, TTL and the size bound."""

from __future__ import annotations

import pytest

from baton.common.index import keys
from baton.common.index.prefix_index import PrefixIndex, chain_lengths

from .helpers import wait_until

MODEL = "tiny-model"
H = [bytes([i]) * 16 for i in range(8)]  # a chain of block hashes, H[0] first


def test_chain_lengths_stop_at_the_first_gap():
    assert chain_lengths([{"a", "b"}, {"a"}, {"a", "b"}]) == {"a": 3, "b": 1}
    assert chain_lengths([{"b"}, set(), {"b"}]) == {"b": 1}
    assert chain_lengths([set(), {"a"}]) == {}
    assert chain_lengths([]) == {}


def test_longest_prefix_with_two_workers(client):
    index = PrefixIndex(client, MODEL, max_entries=100)
    index.add("A", H[:3])
    index.add("B", [H[0], H[2], H[3]])  # B lacks H[1]: only its first block counts
    index.add("C", H[1:4])  # C lacks H[0]: none of its blocks counts
    assert index.longest_prefix(H[:5]) == {"A": 3, "B": 1}
    assert index.longest_prefix(H[:2]) == {"A": 2, "B": 1}
    assert index.longest_prefix(H[1:4]) == {"A": 2, "C": 3}
    assert index.longest_prefix([H[7]]) == {}
    assert index.longest_prefix([]) == {}


def test_remove_on_evict_cuts_the_chain(client):
    index = PrefixIndex(client, MODEL, max_entries=100)
    index.add("A", H[:4])
    index.add("B", H[:4])
    assert index.remove("A", [H[1]]) == 1
    assert index.longest_prefix(H[:4]) == {"A": 1, "B": 4}
    assert index.remove("A", [H[1]]) == 0  # already gone
    # The last holder leaving deletes the entry and frees its place in the bound.
    assert index.forget_worker("B", H[:4]) == 4
    assert not client.exists(keys.prefix_key(MODEL, H[1]))
    assert index.num_entries() == 3
    assert index.longest_prefix(H[:4]) == {"A": 1}


def test_models_are_separate(client):
    PrefixIndex(client, "model-a", max_entries=100).add("A", H[:2])
    assert PrefixIndex(client, "model-b", max_entries=100).longest_prefix(H[:2]) == {}


def test_bound_evicts_the_oldest_entries(client):
    index = PrefixIndex(client, MODEL, max_entries=4)
    for h in H[:6]:  # one add per block: H[0] is the oldest
        index.add("A", [h])
    assert index.num_entries() == 4
    assert [bool(client.exists(keys.prefix_key(MODEL, h))) for h in H[:6]] == [False] * 2 + [True] * 4
    # Re-adding refreshes: H[2] becomes the newest, so H[3] goes next.
    index.add("A", [H[2]])
    index.add("A", [H[6]])
    assert not client.exists(keys.prefix_key(MODEL, H[3]))
    assert client.exists(keys.prefix_key(MODEL, H[2]))
    assert client.dbsize() == 4 + 1  # four entries and the LRU set, nothing else


def test_bound_drops_chain_tails_before_heads(client):
    index = PrefixIndex(client, MODEL, max_entries=3)
    index.add("A", H[:5])
    assert index.longest_prefix(H[:5]) == {"A": 3}


def test_entries_expire_by_ttl_and_add_refreshes_it(client):
    index = PrefixIndex(client, MODEL, max_entries=100, ttl_s=0.5)
    index.add("A", H[:2])
    ttl = client.pttl(keys.prefix_key(MODEL, H[0]))
    assert 0 < ttl <= 500
    assert wait_until(lambda: index.longest_prefix(H[:2]) == {}, timeout_s=5.0)
    # Stale LRU members are dropped on the next add, so they do not count against the bound.
    index.add("B", [H[5]])
    assert index.num_entries() == 1


def test_bad_arguments_are_refused(client):
    with pytest.raises(ValueError):
        PrefixIndex(client, MODEL, max_entries=0)
    with pytest.raises(ValueError):
        PrefixIndex(client, MODEL, max_entries=1, ttl_s=0)
    with pytest.raises(ValueError):
        PrefixIndex(client, MODEL, max_entries=1).add("A", [b""])
