"""What travels on the wire, shared by both transports. No torch.

One ``send`` becomes one *message*: a fixed-size preamble, a small JSON header naming the transfer
and the destination runs, then one payload per run. A run is a stretch of blocks whose source ids
and destination ids are both consecutive, so it is one contiguous slice of each cache and moves as
one payload with no staging copy. (A message carrying some of each block's layers has one payload
per block instead: ``Header.layers``.)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"BTKV"
_PREAMBLE = struct.Struct("<4sIQQ")  # magic, kind, stream tag, header length
PREAMBLE_BYTES = _PREAMBLE.size
MAX_HEADER_BYTES = 1 << 22
HEAD_BYTES = 4096
"""A fixed-size *head*: the preamble, then as much of the header as fits (zero-padded). Receivers
post it before they know the header's length, so one message carries both (no extra round)."""

KIND_DATA = 1
KIND_BYE = 2
KIND_KEEPALIVE = 3


@dataclass(frozen=True)
class Run:
    """``count`` blocks from ``src`` on the sender to ``dst`` on the receiver, both consecutive."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class Preamble:
    kind: int
    tag: int
    """Stream tag of the header and payloads that follow (ucx); 0 where order is implicit."""
    header_len: int


@dataclass(frozen=True)
class Header:
    transfer_id: str
    runs: tuple[tuple[int, int], ...]
    """(first destination block, count) per payload, in payload order."""
    heads: tuple[int, int] | None = None
    """Destination KV heads ``[start, end)`` the payloads carry, packed ``[count, layers, 2, heads,
    bs, row]`` (a re-sharded transfer, ``reshard.py``); None: all of them."""
    layers: tuple[int, int] | None = None
    """Destination layers ``[start, end)`` the payloads carry; None: all of them. Where given, the
    payloads are one per block (``[1, layers, 2, heads, bs, row]``), not one per run: a layer range
    of a block with all its heads is one contiguous region of either cache, moved without a copy."""

    def pieces(self) -> list[tuple[int, int]]:
        """(first destination block, count) of each payload, in payload order."""
        if self.layers is None:
            return list(self.runs)
        return [(b, 1) for b in self.dst_block_ids()]

    def dst_block_ids(self) -> list[int]:
        return [start + i for start, count in self.runs for i in range(count)]


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> list[int]:
    """``block_ids`` as a list of ints, or ValueError if out of range or repeated."""
    ids = [int(i) for i in block_ids]
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids out of range [0, {num_blocks}): {bad[:8]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} block ids repeat: {ids}")
    return ids


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Group pairs into runs where both ids advance by one, keeping the given order."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[Run] = []
    for s, d in zip(src, dst):
        last = runs[-1] if runs else None
        if last is not None and s == last.src + last.count and d == last.dst + last.count:
            runs[-1] = Run(last.src, last.dst, last.count + 1)
        else:
            runs.append(Run(s, d, 1))
    return runs


def encode_preamble(preamble: Preamble) -> bytes:
    return _PREAMBLE.pack(MAGIC, preamble.kind, preamble.tag, preamble.header_len)


def decode_preamble(data: bytes | bytearray | memoryview) -> Preamble:
    magic, kind, tag, header_len = _PREAMBLE.unpack(bytes(data))
    if magic != MAGIC or kind not in (KIND_DATA, KIND_BYE, KIND_KEEPALIVE) or header_len > MAX_HEADER_BYTES:
        raise ValueError(f"not a KV transfer preamble: {bytes(data)!r}")
    return Preamble(kind, tag, header_len)


def encode_head(kind: int, tag: int, header: bytes) -> tuple[bytes, bytes]:
    """The ``HEAD_BYTES`` head for a message, and the header's tail that did not fit (often b"")."""
    data = encode_preamble(Preamble(kind, tag, len(header))) + header
    return data[:HEAD_BYTES].ljust(HEAD_BYTES, b"\0"), data[HEAD_BYTES:]


def decode_head(data: bytes | bytearray | memoryview) -> tuple[Preamble, bytes]:
    """The preamble of a head and the part of the header it holds (ValueError if malformed)."""
    preamble = decode_preamble(data[:PREAMBLE_BYTES])
    return preamble, bytes(data[PREAMBLE_BYTES : PREAMBLE_BYTES + preamble.header_len])


def encode_header(
    transfer_id: str,
    runs: Sequence[Run],
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> bytes:
    body: dict = {"t": transfer_id, "r": [[r.dst, r.count] for r in runs]}
    if heads is not None:
        body["h"] = list(heads)
    if layers is not None:
        body["l"] = list(layers)
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes is too large")
    return data


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    body = json.loads(bytes(data))
    runs = tuple((int(start), int(count)) for start, count in body["r"])
    heads = (int(body["h"][0]), int(body["h"][1])) if "h" in body else None
    layers = (int(body["l"][0]), int(body["l"][1])) if "l" in body else None
    return Header(str(body["t"]), runs, heads, layers)


def plan_message(
    transfer_id: str,
    src: Sequence[int],
    dst: Sequence[int],
    num_blocks: int,
    heads: tuple[int, int] | None = None,
    layers: tuple[int, int] | None = None,
) -> tuple[list[Run], bytes]:
    """Validate one ``send`` and return its runs and encoded header (ValueError if malformed)."""
    src_ids = check_block_ids(src, num_blocks, "source")
    runs = coalesce(src_ids, check_block_ids(dst, 2**62, "destination"))
    return runs, encode_header(transfer_id, runs, heads, layers)
