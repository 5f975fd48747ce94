"""Key names, one key space per model: ``baton:<model>:...``. Pure: imports neither redis nor torch.

Every key the index writes is built here, so that the layout can be read in one place:

- ``baton:<model>:worker:<worker id>``        string, a worker's JSON record, TTL by heartbeat
- ``baton:<model>:prefix:<block hash hex>``   set of worker ids that cache the block, TTL
- ``baton:<model>:prefix-lru``                sorted set, block hash hex -> last add time (the bound)
- ``baton:<model>:loc:<request id>``          hash, where a request's KV blocks go, TTL
"""

from __future__ import annotations

import re

ROOT = "baton"

# Characters that SCAN's MATCH treats as glob syntax.
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    return value


def model_space(model: str) -> str:
    """The prefix every key of ``model`` starts with."""
    return f"{ROOT}:{_check_name('model', model)}:"


def worker_key(model: str, worker_id: str) -> str:
    """The registry record of one worker."""
    return f"{model_space(model)}worker:{_check_name('worker id', worker_id)}"


def worker_pattern(model: str) -> str:
    """A SCAN MATCH pattern for every worker record of ``model`` (glob characters escaped)."""
    return f"{escape_glob(model_space(model))}worker:*"


def worker_id_from_key(model: str, key: str) -> str:
    """Inverse of :func:`worker_key`."""
    head = f"{model_space(model)}worker:"
    if not key.startswith(head):
        raise ValueError(f"{key!r} is not a worker key of model {model!r}")
    return key[len(head) :]


def prefix_member(block_hash: bytes) -> str:
    """How a block hash is spelled inside keys and in the LRU sorted set: lowercase hex."""
    if not isinstance(block_hash, bytes) or not block_hash:
        raise ValueError(f"a block hash must be non-empty bytes, got {block_hash!r}")
    return block_hash.hex()


def prefix_key_head(model: str) -> str:
    """``prefix_key(model, h) == prefix_key_head(model) + prefix_member(h)``."""
    return f"{model_space(model)}prefix:"


def prefix_key(model: str, block_hash: bytes) -> str:
    """The set of worker ids that cache the block named ``block_hash``."""
    return prefix_key_head(model) + prefix_member(block_hash)


def prefix_lru_key(model: str) -> str:
    """The sorted set that orders the prefix entries by last add, for the size bound."""
    return f"{model_space(model)}prefix-lru"


def location_key(model: str, request_id: str) -> str:
    """The block-location record of one request."""
    return f"{model_space(model)}loc:{_check_name('request id', request_id)}"


def escape_glob(text: str) -> str:
    """``text`` with Redis glob characters escaped, to match itself literally in a pattern."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)
