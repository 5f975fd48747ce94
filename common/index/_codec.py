"""Reply decoding that works whether the client was built with ``decode_responses`` or not."""

from __future__ import annotations


def as_text(value: bytes | str) -> str:
    """A Redis reply value as ``str`` (UTF-8)."""
    return value.decode() if isinstance(value, bytes) else value


def ttl_ms(ttl_s: float) -> int:
    """A TTL in whole milliseconds for PX/PEXPIRE; refuses non-positive TTLs."""
    ms = int(round(ttl_s * 1000))
    if ms <= 0:
        raise ValueError(f"ttl must be positive, got {ttl_s!r} s")
    return ms
