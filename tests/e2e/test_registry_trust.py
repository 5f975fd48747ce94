"""The gateway's trust in the registry (issue 28): with a cluster secret it routes only to workers
whose records are signed with it, and with ``--expect-prefill N`` its ``/ready`` waits for N
prefill workers. Real parts: a redis-server that asks a password, the gateway app, and gRPC servers
on 127.0.0.1 standing in for workers (health SERVING; every call they get is recorded)."""

from __future__ import annotations

import secrets

import pytest
from fastapi.testclient import TestClient

from baton.common.index.client import connect
from baton.common.index.registry import WorkerRegistry
from baton.common.index.server import EmbeddedRedis, EmbeddedRedisConfig
from baton.common.model.source import ModelSource
from baton.services.gateway.app import GatewayConfig, create_app

from .fault_cluster import wait_for
from .forged_worker import forged, recording_server, write_forgeries

SECRET = b"test-cluster-secret"


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis(EmbeddedRedisConfig(password=secrets.token_urlsafe(16))) as server:
        yield server.url


@pytest.fixture()
def registry(redis_url):
    client = connect(redis_url)
    client.flushdb()
    yield WorkerRegistry(client, ModelSource.resolve(None).name, ttl_s=60, secret=SECRET)
    client.close()


def _gateway(redis_url: str, **config) -> TestClient:
    return TestClient(create_app(GatewayConfig(redis_url=redis_url, registry_refresh_s=0.1, **config)))


def test_ready_waits_for_the_prefill_workers_expected(redis_url, registry):
    with recording_server() as (address, _):
        registry.register(forged("decode-0", "decode", address))  # signed: a real worker here
        with _gateway(redis_url, cluster_secret=SECRET, expect_prefill=1) as http:
            first = http.get("/ready")
            assert first.status_code == 503, first.json()
            assert first.json()["reason"] == "0 of the 1 prefill workers expected are registered"
            registry.register(forged("prefill-0", "prefill", address))
            wait_for(
                lambda: http.get("/ready").status_code == 200, 10, "the gateway to see the prefill worker"
            )
            assert http.get("/ready").json()["prefill_workers"] == 1
        with _gateway(redis_url, cluster_secret=SECRET) as http:  # no pool expected: as before
            assert http.get("/ready").json()["decode_workers"] == 1


def test_records_without_the_cluster_secret_are_no_workers(redis_url, registry):
    with recording_server() as (real, _), recording_server() as (attacker, calls):
        registry.register(forged("decode-0", "decode", real))
        write_forgeries(registry._client, ModelSource.resolve(None).name, attacker)
        with _gateway(redis_url, cluster_secret=SECRET) as http:
            assert http.get("/ready").json()["decode_workers"] == 1
            assert [w["id"] for w in http.get("/workers").json()["workers"]] == ["decode-0"]
            metrics = http.get("/metrics").text
            rejected = [line for line in metrics.splitlines() if line.startswith("baton:registry_rejected")]
            assert rejected and float(rejected[0].rsplit(" ", 1)[1]) >= 3, rejected
        assert calls == []
        # The same Redis read by a gateway without the secret: every record is a worker, as before.
        with _gateway(redis_url) as http:
            ids = {w["id"] for w in http.get("/workers").json()["workers"]}
            assert ids == {"decode-0", "0-forged-decode", "0-forged-prefill", "0-replayed"}
