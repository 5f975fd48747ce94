"""Chained block hashes: prefix property, full blocks only, stable across processes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from baton.common.engine.hashing import BlockHasher, hash_block_tokens, sha256_16

TOKENS = list(range(100, 114))  # 14 tokens: 3 full blocks of 4 and a partial one of 2


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher(block_size=4)
    assert len(hasher.hash_blocks(TOKENS)) == 3
    assert len(hasher.hash_blocks(TOKENS[:12])) == 3
    assert len(hasher.hash_blocks(TOKENS[:11])) == 2
    assert hasher.hash_blocks(TOKENS[:3]) == []
    assert hasher.hash_blocks([]) == []
    # The partial tail does not leak into the full blocks' hashes.
    assert hasher.hash_blocks(TOKENS) == hasher.hash_blocks(TOKENS[:12])
    assert hasher.hash_blocks(TOKENS[:11]) == hasher.hash_blocks(TOKENS[:8])


@pytest.mark.parametrize("changed", [0, 5, 11])
def test_changing_one_token_changes_its_block_and_every_later_one(changed):
    hasher = BlockHasher(block_size=4)
    base = hasher.hash_blocks(TOKENS)
    tokens = list(TOKENS)
    tokens[changed] += 1000
    new = hasher.hash_blocks(tokens)
    block = changed // 4
    assert new[:block] == base[:block]
    for i in range(block, 3):
        assert new[i] != base[i], f"block {i} kept its hash after token {changed} changed"


def test_same_block_after_a_different_prefix_hashes_differently():
    # Block 1 holds the same tokens in both sequences; only block 0 differs.
    hasher = BlockHasher(block_size=4)
    a = hasher.hash_blocks([1, 2, 3, 4, 9, 9, 9, 9])
    b = hasher.hash_blocks([1, 2, 3, 5, 9, 9, 9, 9])
    assert a[1] != b[1]


def test_hashes_are_16_bytes_and_distinct():
    hashes = BlockHasher(block_size=4).hash_blocks(TOKENS)
    assert all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert len(set(hashes)) == 3


def test_block_size_is_part_of_the_name():
    # Two blocks of 2 must not be named like one block of 4 with the same tokens.
    h2 = BlockHasher(block_size=2).hash_blocks([1, 2, 3, 4])
    h4 = BlockHasher(block_size=4).hash_blocks([1, 2, 3, 4])
    assert h4[0] not in h2


def test_encoding_matches_the_documented_format():
    """h(parent, tokens) = sha256(parent || u32 len || u32 tokens...)[:16], root = h(b"baton-root" || seed).

    Pinned with an independent implementation: workers on other machines (and other versions)
    must name blocks the same way.
    """
    seed = b"model-a"

    def ref(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()[:16]

    prev = ref(b"baton-root" + seed)
    expected = []
    for i in range(3):
        block = TOKENS[4 * i : 4 * i + 4]
        prev = ref(prev + struct.pack("<I", 4) + struct.pack("<4I", *block))
        expected.append(prev)
    assert BlockHasher(block_size=4, seed=seed).hash_blocks(TOKENS) == expected
    assert sha256_16(b"abc") == hashlib.sha256(b"abc").digest()[:16]


def test_hash_block_tokens_without_parent_uses_zero_head():
    got = hash_block_tokens(sha256_16, None, [7, 8])
    assert got == sha256_16(b"\x00" * 16 + struct.pack("<I", 2) + struct.pack("<2I", 7, 8))
    assert hash_block_tokens(sha256_16, None, [7, 8], ("x",)) != got


_CHILD = """
import json, sys
from baton.common.engine.hashing import BlockHasher
tokens = list(range(100, 114))
out = {
    "plain": [h.hex() for h in BlockHasher(4).hash_blocks(tokens)],
    "seeded": [h.hex() for h in BlockHasher(4, seed=b"model-a").hash_blocks(tokens)],
    "extra": [h.hex() for h in BlockHasher(4).hash_blocks(tokens, extra_keys=("lora-1", 3))],
    "str_hash": hash("salted per process"),
}
print(json.dumps(out))
"""


def _hashes_in_child(hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    return json.loads(proc.stdout)


def test_hashes_are_identical_across_processes_with_different_hash_seeds():
    a = _hashes_in_child("1")
    b = _hashes_in_child("2")
    # The two children really salt Python's hash() differently...
    assert a["str_hash"] != b["str_hash"]
    # ...yet name blocks identically, and the same as this process does.
    hasher = BlockHasher(block_size=4)
    here = {
        "plain": [h.hex() for h in hasher.hash_blocks(TOKENS)],
        "seeded": [h.hex() for h in BlockHasher(4, seed=b"model-a").hash_blocks(TOKENS)],
        "extra": [h.hex() for h in hasher.hash_blocks(TOKENS, extra_keys=("lora-1", 3))],
    }
    for key in ("plain", "seeded", "extra"):
        assert a[key] == b[key] == here[key], key
        assert len(here[key]) == 3


def test_seed_separates_key_spaces():
    plain = BlockHasher(block_size=4).hash_blocks(TOKENS)
    seed_a = BlockHasher(block_size=4, seed=b"a").hash_blocks(TOKENS)
    seed_b = BlockHasher(block_size=4, seed=b"b").hash_blocks(TOKENS)
    assert not set(plain) & set(seed_a)
    assert not set(seed_a) & set(seed_b)
    assert BlockHasher(block_size=4, seed=b"a").hash_blocks(TOKENS) == seed_a


def test_extra_keys_separate_key_spaces():
    hasher = BlockHasher(block_size=4)
    plain = hasher.hash_blocks(TOKENS)
    lora1 = hasher.hash_blocks(TOKENS, extra_keys=("lora-1",))
    lora2 = hasher.hash_blocks(TOKENS, extra_keys=("lora-2",))
    assert len(set(plain) | set(lora1) | set(lora2)) == 9
    assert hasher.hash_blocks(TOKENS, extra_keys=("lora-1",)) == lora1
    # A seed and an extra key with the same spelling are still different names.
    seeded = BlockHasher(block_size=4, seed=b"lora-1").hash_blocks(TOKENS)
    assert not set(seeded) & set(lora1)


@pytest.mark.parametrize("start_block", [1, 2, 3])
def test_continuing_from_a_parent_equals_hashing_everything_at_once(start_block):
    hasher = BlockHasher(block_size=4, seed=b"s")
    whole = hasher.hash_blocks(TOKENS)
    head = hasher.hash_blocks(TOKENS[: 4 * start_block])
    tail = hasher.hash_blocks(TOKENS, parent=head[-1], start_block=start_block)
    assert head + tail == whole
    assert len(tail) == 3 - start_block


def test_continuation_with_extra_keys_matches_too():
    hasher = BlockHasher(block_size=4)
    whole = hasher.hash_blocks(TOKENS, extra_keys=("k",))
    head = hasher.hash_blocks(TOKENS[:4], extra_keys=("k",))
    assert head + hasher.hash_blocks(TOKENS, parent=head[-1], start_block=1, extra_keys=("k",)) == whole


def test_explicit_root_parent_equals_default():
    hasher = BlockHasher(block_size=4, seed=b"s")
    assert hasher.hash_blocks(TOKENS, parent=hasher.root()) == hasher.hash_blocks(TOKENS)
    assert BlockHasher(4, seed=b"s").root() != BlockHasher(4, seed=b"t").root()
