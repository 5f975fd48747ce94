"""Worker registry against a real Redis: register, list, heartbeat, expiry, deregister."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from baton.common.index.registry import Heartbeat, WorkerInfo, WorkerRegistry

from .helpers import wait_until

MODEL = "tiny-model"


def _worker(worker_id: str, role: str = "prefill", **load: float) -> WorkerInfo:
    return WorkerInfo(
        id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=f"127.0.0.1:{5000 + len(worker_id)}",
        kv_address=f"tcp://127.0.0.1:{6000 + len(worker_id)}",
        metrics_url=f"http://127.0.0.1:{7000 + len(worker_id)}/metrics",
        load=load,
    )


def test_worker_info_round_trips_through_json():
    info = _worker("p0", queued_prefill_tokens=12.0, free_blocks=100.0)
    assert WorkerInfo.from_json(info.to_json()) == info
    assert info.with_load(num_running=3.0).load == {"num_running": 3.0}
    shown = replace(info, settings={"dtype": "bfloat16", "cpus": "0,1", "threads": 2, "colocated": True})
    assert WorkerInfo.from_json(shown.to_json()) == shown
    assert WorkerInfo.from_dict({k: v for k, v in info.to_dict().items() if k != "settings"}).settings == {}
    with pytest.raises(ValueError, match="role"):
        _worker("x", role="router")


def test_register_list_by_role_and_deregister(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=30)
    p0, p1, d0 = _worker("p0"), _worker("p1"), _worker("d0", role="decode", free_blocks=64.0)
    for info in (p1, d0, p0):
        registry.register(info)
    assert registry.list() == [d0, p0, p1]
    assert registry.list(role="prefill") == [p0, p1]
    assert registry.list(role="decode") == [d0]
    assert registry.get("d0") == d0
    assert registry.deregister("p1") is True
    assert registry.deregister("p1") is False
    assert [w.id for w in registry.list()] == ["d0", "p0"]


def test_models_do_not_see_each_other(client):
    WorkerRegistry(client, "model-a", ttl_s=30).register(_worker("w"))
    assert WorkerRegistry(client, "model-b", ttl_s=30).list() == []
    # A model name with glob characters matches only itself.
    WorkerRegistry(client, "model-*", ttl_s=30).register(_worker("star"))
    assert [w.id for w in WorkerRegistry(client, "model-*", ttl_s=30).list()] == ["star"]


def test_list_works_with_decoded_responses(redis_server):
    conn = redis.Redis.from_url(redis_server.url, decode_responses=True)
    conn.flushdb()
    registry = WorkerRegistry(conn, MODEL, ttl_s=30)
    registry.register(_worker("p0"))
    assert [w.id for w in registry.list()] == ["p0"]
    conn.close()


def test_heartbeat_refreshes_load_and_ttl(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=30)
    registry.register(_worker("p0", queued_prefill_tokens=0.0))
    client.pexpire("baton:tiny-model:worker:p0", 1000)
    registry.heartbeat(_worker("p0", queued_prefill_tokens=512.0))
    assert registry.get("p0").load == {"queued_prefill_tokens": 512.0}
    assert client.pttl("baton:tiny-model:worker:p0") > 29_000


def test_a_silent_worker_expires(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=0.5)
    registry.register(_worker("p0"))
    registry.register(_worker("d0", role="decode"))
    assert len(registry.list()) == 2
    assert wait_until(lambda: registry.list() == [], timeout_s=5.0)


def test_heartbeat_thread_keeps_a_worker_alive_past_its_ttl(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=0.4)
    beats = iter(range(10_000))
    beat = Heartbeat(registry, lambda: _worker("d0", role="decode", num_running=float(next(beats))))
    assert not beat.running and registry.list() == []  # the constructor starts nothing
    beat.start()
    try:
        assert registry.get("d0") is not None  # registered in start(), before the first beat
        # Alive well past the TTL, with the load of later beats.
        assert wait_until(lambda: (w := registry.get("d0")) is not None and w.load["num_running"] >= 4, 5.0)
    finally:
        beat.stop()
    assert not beat.running
    assert registry.get("d0") is None  # stop() deregisters at once


def test_beat_now_publishes_at_once(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=60)  # beats every 20 s unless asked
    state = {"n": 0.0}
    beat = Heartbeat(registry, lambda: _worker("d1", role="decode", prefill_connected=state["n"]))
    beat.start()
    try:
        state["n"] = 1.0
        beat.beat_now()
        assert wait_until(lambda: registry.get("d1").load["prefill_connected"] == 1.0, 5.0)
    finally:
        beat.stop()


def test_a_stopped_heartbeat_without_deregister_expires_by_ttl(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=0.4)
    with pytest.raises(RuntimeError, match="already started"):
        with Heartbeat(registry, _worker("p0")) as beat:
            beat.start()
    beat = Heartbeat(registry, _worker("p0"))
    beat.start()
    beat.stop(deregister=False)
    assert registry.get("p0") is not None
    assert wait_until(lambda: registry.get("p0") is None, timeout_s=5.0)


def test_with_a_secret_only_signed_records_are_listed(client, caplog):
    """An attacker who can write Redis but lacks the cluster secret adds no worker: an unsigned
    record, a legitimate record edited to point elsewhere, one copied under another worker's key,
    and one signed with another secret are all left out, warned about once per id and counted."""
    import json

    secret = b"cluster-secret"
    registry = WorkerRegistry(client, MODEL, ttl_s=30, secret=secret)
    d0, p0 = _worker("d0", role="decode", free_blocks=64.0), _worker("p0")
    registry.register(d0)
    registry.register(p0)
    key = f"baton:{MODEL}:worker:"
    signed = json.loads(client.get(key + "d0"))
    client.set(key + "evil", _worker("evil", role="decode").to_json())  # unsigned
    client.set(key + "d0-moved", json.dumps({**signed, "grpc_address": "127.0.0.1:6666"}))
    client.set(key + "d0-copy", json.dumps(signed))  # replayed under another id
    WorkerRegistry(client, MODEL, ttl_s=30, secret=b"other").register(_worker("stranger"))
    client.set(key + "junk", b"\xff not json")
    with caplog.at_level("WARNING", logger="baton.common.index.registry"):
        assert registry.list() == [d0, p0]
        assert registry.list(role="decode") == [d0]
    assert registry.get("evil") is None and registry.get("d0") == d0
    assert registry.num_rejected == 2 * 5 + 1
    warned = sorted(r.getMessage().split("'")[1] for r in caplog.records)
    assert warned == ["d0-copy", "d0-moved", "evil", "junk", "stranger"]
    # A reader without a secret sees every parseable record, as before secrets existed.
    client.delete(key + "junk")
    assert {w.id for w in WorkerRegistry(client, MODEL, ttl_s=30).list()} == {"d0", "p0", "evil", "stranger"}


def test_a_signed_heartbeat_keeps_its_worker_listed(client):
    registry = WorkerRegistry(client, MODEL, ttl_s=0.6, secret=b"s")
    with Heartbeat(registry, _worker("p0")):
        assert wait_until(lambda: registry.list() == [_worker("p0")], 1.0)
        assert wait_until(lambda: False, 1.0) is False  # past the TTL: kept alive by the beats
        assert registry.list() == [_worker("p0")] and registry.num_rejected == 0
