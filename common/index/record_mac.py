"""HMAC-SHA256 over worker registry records, with a secret the cluster's services share.

Without it, any process that can write Redis can register a "worker" at its own address and have
prompts routed to it. With a secret configured, writers sign each record and readers ignore the
records whose MAC is missing or wrong (``registry.WorkerRegistry``).

A signed record is the worker's JSON object with two more fields: ``expires_unix_s`` (wall clock;
past it, and ``max_skew_s`` of clock difference between hosts, the signature is no longer
accepted, so a copied record cannot keep a dead worker alive) and ``mac`` (hex). The MAC covers
the Redis key the record is stored under, which names the model and the worker id, so a record
replayed under another key fails, and the canonical JSON of every other field, so any edit fails.

Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from baton.env import CLUSTER_SECRET

SECRET_ENV = CLUSTER_SECRET.name
"""The environment variable of the secret (``BATON_CLUSTER_SECRET_FILE``: a file holding it)."""
MAC_FIELD = "mac"
EXPIRES_FIELD = "expires_unix_s"


def canonical(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no spaces. A value that went through
    ``json.loads(json.dumps(...))`` gives the same bytes as before, so reader and writer agree."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class RecordSigner:
    """Signs and verifies registry records with one secret."""

    def __init__(self, secret: bytes, max_skew_s: float = 60.0) -> None:
        """``max_skew_s``: how far the reader's clock may run ahead of the writer's."""
        if not secret:
            raise ValueError("a cluster secret must be non-empty")
        self._secret = secret
        self.max_skew_s = max_skew_s

    def __repr__(self) -> str:
        return f"RecordSigner(max_skew_s={self.max_skew_s})"  # never the secret

    def mac(self, key: str, fields: Mapping[str, Any]) -> str:
        """The hex HMAC-SHA256 of ``key`` and ``fields`` (a JSON object without ``mac``)."""
        return hmac.new(self._secret, canonical([key, fields]), hashlib.sha256).hexdigest()

    def sign(self, key: str, fields: Mapping[str, Any], expires_unix_s: float) -> dict[str, Any]:
        """``fields`` as they will read back from JSON, with ``expires_unix_s`` and their ``mac``
        for storing under ``key``."""
        signed = json.loads(json.dumps({**fields, EXPIRES_FIELD: float(expires_unix_s)}))
        signed.pop(MAC_FIELD, None)
        return {**signed, MAC_FIELD: self.mac(key, signed)}

    def verify(self, key: str, record: Any, now_unix_s: float) -> str | None:
        """Why ``record`` (parsed JSON read under ``key``) is not to be trusted, or None if it is."""
        if not isinstance(record, dict):
            return "not a JSON object"
        mac = record.get(MAC_FIELD)
        if not isinstance(mac, str):
            return "unsigned (its writer has no cluster secret)"
        fields = {k: v for k, v in record.items() if k != MAC_FIELD}
        if not hmac.compare_digest(mac.encode(), self.mac(key, fields).encode()):
            return "bad MAC (not signed with this cluster's secret, or signed for another key)"
        expires = fields.get(EXPIRES_FIELD)
        if not isinstance(expires, float) or not now_unix_s <= expires + self.max_skew_s:
            return "signature expired (or this host's clock runs ahead of the writer's)"
        return None
