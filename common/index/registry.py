"""Worker registry: one Redis key per worker, refreshed by heartbeat. Discovery and liveness in one:
a worker that stops heartbeating vanishes when its key's TTL runs out. With a cluster secret, each
record carries an HMAC (``record_mac``) and readers ignore records without a valid one."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from baton.common.index import keys
from baton.common.index._codec import as_text, ttl_ms
from baton.common.index.outage import OutageLog
from baton.common.index.record_mac import RecordSigner

log = logging.getLogger(__name__)

MAX_WARNED_IDS = 1024
"""Worker ids whose rejected records are warned about (once each); past it, only counted."""

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker publishes about itself (the gateway's ``GET /workers`` shows it as is)."""

    id: str
    """Unique worker id within a model."""
    role: Role
    """``"prefill"`` or ``"decode"``."""
    grpc_address: str
    """``host:port`` of the worker's gRPC server."""
    kv_address: str
    """Where the KV transport reaches the worker (transport-specific)."""
    metrics_url: str
    """URL of the worker's Prometheus ``/metrics``."""
    load: Mapping[str, float] = field(default_factory=dict)
    """Load figures for routing, e.g. ``queued_prefill_tokens``, ``free_blocks``, ``num_running``."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """How the worker runs, for operators: dtype, cores, threads (JSON values)."""

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("a worker id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def with_load(self, **load: float) -> WorkerInfo:
        """A copy with ``load`` replaced."""
        return replace(self, load=dict(load))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "grpc_address": self.grpc_address,
            "kv_address": self.kv_address,
            "metrics_url": self.metrics_url,
            "load": {name: float(value) for name, value in self.load.items()},
            "settings": dict(self.settings),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerInfo:
        return cls(
            id=data["id"],
            role=data["role"],
            grpc_address=data["grpc_address"],
            kv_address=data["kv_address"],
            metrics_url=data["metrics_url"],
            load={name: float(value) for name, value in data.get("load", {}).items()},
            settings=dict(data.get("settings", {})),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        return cls.from_dict(json.loads(text))


class WorkerRegistry:
    """The workers of one model, each under ``baton:<model>:worker:<id>`` with a TTL of ``ttl_s``.

    ``client`` is a ``redis.Redis`` (either ``decode_responses`` setting works). With a ``secret``
    (the cluster's), records are written signed and a record read without a valid MAC (missing,
    wrong, expired, or copied from another key) is left out as if absent: a warning once per worker
    id, and ``num_rejected`` counts every such read. Without one, records are written and read as
    they are.
    """

    def __init__(self, client: Any, model: str, ttl_s: float, secret: bytes | None = None) -> None:
        self._client = client
        self._model = model
        self._ttl_ms = ttl_ms(ttl_s)
        self.ttl_s = ttl_s
        self._signer = RecordSigner(secret) if secret else None
        self._lock = threading.Lock()  # readers run on several threads (the gateway's Redis pool)
        self._warned: set[str] = set()
        self.num_rejected = 0
        """Records read and left out for their MAC, since this registry was made (a counter)."""

    def register(self, info: WorkerInfo) -> bool:
        """Publish ``info`` with a fresh TTL (replacing any earlier record of the same id); whether
        a record of it was there already. EXISTS and SET run in one MULTI, so the answer is about
        the very record this SET replaced (Redis 6+; ``SET ... GET`` would need 6.2)."""
        key = keys.worker_key(self._model, info.id)
        pipe = self._client.pipeline(transaction=True)
        pipe.exists(key)
        pipe.set(key, self._encode(key, info), px=self._ttl_ms)
        existed, _ = pipe.execute()
        return bool(existed)

    def heartbeat(self, info: WorkerInfo) -> bool:
        """Refresh the TTL and the load; whether the record was still there. Also re-creates a
        record that was gone (it expired during a pause, or Redis restarted empty), so a live worker
        comes back on its next beat: False says that Redis forgot it meanwhile."""
        return self.register(info)

    def deregister(self, worker_id: str) -> bool:
        """Remove a worker at once; whether it was registered."""
        return bool(self._client.delete(keys.worker_key(self._model, worker_id)))

    def get(self, worker_id: str) -> WorkerInfo | None:
        """One worker's record, or None if absent or expired."""
        key = keys.worker_key(self._model, worker_id)
        raw = self._client.get(key)
        return None if raw is None else self._decode(key, raw)

    def list(self, role: Role | None = None) -> list[WorkerInfo]:
        """Live workers of this model, sorted by id, optionally only one role."""
        names = [
            as_text(k) for k in self._client.scan_iter(match=keys.worker_pattern(self._model), count=256)
        ]
        if not names:
            return []
        # A key can expire between SCAN and MGET: its value comes back None and is skipped.
        values = self._client.mget(names)
        found = (self._decode(k, v) for k, v in zip(names, values) if v is not None)
        workers = [w for w in found if w is not None]
        return sorted((w for w in workers if role is None or w.role == role), key=lambda w: w.id)

    def _encode(self, key: str, info: WorkerInfo) -> str:
        if self._signer is None:
            return info.to_json()
        signed = self._signer.sign(key, info.to_dict(), time.time() + self.ttl_s)
        return json.dumps(signed, sort_keys=True)

    def _decode(self, key: str, raw: str | bytes) -> WorkerInfo | None:
        """The record read under ``key``; None (and counted) when a secret is set and it fails."""
        if self._signer is None:
            return WorkerInfo.from_json(raw)
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        reason = self._signer.verify(key, record, time.time())
        if reason is None:
            try:
                return WorkerInfo.from_dict(record)
            except (KeyError, TypeError, ValueError, AttributeError):
                reason = "signed but malformed"
        self._reject(key, reason)
        return None

    def _reject(self, key: str, reason: str) -> None:
        worker_id = keys.worker_id_from_key(self._model, key)
        with self._lock:
            self.num_rejected += 1
            first = worker_id not in self._warned and len(self._warned) < MAX_WARNED_IDS
            if first:
                self._warned.add(worker_id)
        if first:
            log.warning("ignoring the registry record of worker %r: %s", worker_id, reason)


class Heartbeat:
    """Calls ``registry.heartbeat`` every ``interval_s`` (default ``ttl / 3``) on a daemon thread.

    ``source`` is the record to publish, or a function returning the current one (so that the load
    is fresh on each beat). ``start()`` registers once in the caller's thread, so that a bad
    address or an unreachable Redis fails loudly, then starts the thread; ``stop()`` ends the
    thread and, by default, deregisters. A failed beat is retried on the next one; an outage is
    logged when it starts, every 30 s while it lasts and when it ends, not at every beat.

    ``on_forgotten`` is called (on the heartbeat thread; it must only hand work over) when a beat
    finds that Redis had lost this worker's record: Redis restarted empty, or the worker was
    paused past its TTL. The beat has registered it again; whatever else the worker publishes
    (its cached block hashes) is gone too and worth publishing again.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        source: WorkerInfo | Callable[[], WorkerInfo],
        interval_s: float | None = None,
        on_forgotten: Callable[[], None] | None = None,
    ) -> None:
        self._registry = registry
        self._source = source
        self._interval_s = registry.ttl_s / 3 if interval_s is None else interval_s
        self._on_forgotten = on_forgotten
        self._outage = OutageLog(log, "worker registry (heartbeat)")
        self.num_forgotten = 0
        """Beats that found the record gone and re-created it (for tests and operators)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_id: str | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        info = self._current()
        self._registry.register(info)
        self._worker_id = info.id
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{info.id}", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        """Stop beating; with ``deregister`` the worker leaves the registry now, not at TTL."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._wake.set()
        thread.join()
        if deregister and self._worker_id is not None:
            self._registry.deregister(self._worker_id)

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _current(self) -> WorkerInfo:
        return self._source() if callable(self._source) else self._source

    def beat_now(self) -> None:
        """Publish the current record now rather than at the next interval (a change that others
        wait on, such as a new connection)."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._beat()

    def _beat(self) -> None:
        try:
            present = self._registry.heartbeat(self._current())
        except Exception as e:  # noqa: BLE001 - a beat must not kill the thread; the next one retries
            self._outage.failed(e)
            return
        self._outage.ok()
        if present:
            return
        self.num_forgotten += 1
        log.warning("the worker registry had lost worker %s: registered it again", self._worker_id)
        if self._on_forgotten is not None:
            try:
                self._on_forgotten()
            except Exception:  # noqa: BLE001 - a failed catch-up must not stop the beats
                log.exception("catching up after the registry forgot this worker")
