"""The gateway's patience with a stream's decode workers (``services/gateway/dispatch.py``): the
progress deadline doubles with each migration of the stream, the migration budget counts only those
without a new token since, and a worker is let back in to resume a stream unless its address refuses
connections (a real gRPC call to a closed port)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.common.net import free_port
from baton.protos import baton_pb2
from baton.services.gateway.dispatch import MAX_PATIENCE_DOUBLINGS, Stalled, _Failure, _Progress


def test_no_deadline_before_the_first_token_then_it_doubles_per_migration():
    p = _Progress()
    assert p.patience(3.0) is None  # the request's deadline and the keepalive apply
    p.add(baton_pb2.GenerateChunk(token_ids=[5]))
    assert p.patience(3.0) == 3.0
    waits = []
    for _ in range(MAX_PATIENCE_DOUBLINGS + 2):
        p.migrations += 1
        waits.append(p.patience(3.0))
    assert waits == [6.0, 12.0, 24.0, 24.0, 24.0]  # capped at 2 ** MAX_PATIENCE_DOUBLINGS
    p.add(baton_pb2.GenerateChunk(token_ids=[6]))
    assert p.patience(3.0) == 24.0  # a host that stalled once is given time for the rest


def test_only_migrations_without_a_new_token_count_against_the_budget():
    p = _Progress()
    p.add(baton_pb2.GenerateChunk(token_ids=[5]))
    p.unproductive = 2
    p.add(baton_pb2.GenerateChunk(text="x"))  # text without a token is not progress
    assert p.unproductive == 2
    p.add(baton_pb2.GenerateChunk(token_ids=[6]))
    assert p.unproductive == 0


async def _refused_call() -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return info.value


def test_a_refused_connection_is_unreachable_and_a_stall_or_a_dropped_call_is_not():
    refused = asyncio.run(_refused_call())
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert _Failure(refused, "127.0.0.1:1").unreachable
    assert not _Failure(Stalled(), "127.0.0.1:1").unreachable
    dropped = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Socket closed"
    )
    assert not _Failure(dropped, "127.0.0.1:1").unreachable
