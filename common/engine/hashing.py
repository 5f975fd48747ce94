"""Chained block hashes: ``h(parent, tokens, extra keys)``, the same in every process.

A block's hash names its tokens *and everything before them*, so equal hashes mean equal
prefixes. Python's ``hash()`` is salted per process, so a cryptographic hash over a canonical
byte encoding is used instead: workers on different machines agree on the names.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
HashFn = Callable[[bytes], bytes]


def sha256_16(data: bytes) -> bytes:
    """The default hash function: SHA-256 truncated to 16 bytes (collisions stay out of reach)."""
    return hashlib.sha256(data).digest()[:16]


def _encode_extra(extra_keys: tuple) -> bytes:
    """Canonical bytes of the extra keys (model salt, LoRA name, ...): ints, strings and bytes
    only, since anything whose repr holds an address would differ between processes."""
    out = []
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
            raise TypeError(f"extra keys must be int, str or bytes, got {type(key).__name__}")
        raw = key if isinstance(key, bytes) else str(key).encode()
        out.append(type(key).__name__[0].encode() + struct.pack("<I", len(raw)) + raw)
    return b"".join(out)


def hash_block_tokens(
    hash_fn: HashFn,
    parent: BlockHash | None,
    tokens: Sequence[int],
    extra_keys: tuple = (),
) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    body = struct.pack(f"<{len(tokens)}I", *tokens)
    head = parent if parent is not None else b"\x00" * 16
    return hash_fn(head + struct.pack("<I", len(tokens)) + body + _encode_extra(extra_keys))


@dataclass(frozen=True)
class BlockHasher:
    """Hashes the full blocks of a token sequence into a chain.

    ``seed`` separates key spaces (model name, LoRA, cache salt): the same tokens under another
    seed give unrelated hashes.
    """

    block_size: int
    seed: bytes = b""
    hash_fn: HashFn = sha256_16

    def root(self) -> BlockHash:
        """The parent of the first block."""
        return self.hash_fn(b"baton-root" + self.seed)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
        start_block: int = 0,
        extra_keys: tuple = (),
    ) -> list[BlockHash]:
        """Hashes of the full blocks from ``start_block`` on; ``parent`` is the hash before it."""
        bs = self.block_size
        prev = self.root() if parent is None else parent
        hashes = []
        for i in range(start_block, len(token_ids) // bs):
            prev = hash_block_tokens(self.hash_fn, prev, token_ids[i * bs : (i + 1) * bs], extra_keys)
            hashes.append(prev)
        return hashes
