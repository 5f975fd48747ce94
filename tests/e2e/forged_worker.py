"""An attacker's worker for the locked-doors tests (issue 28): a gRPC server on 127.0.0.1 that
answers health SERVING and records every call it gets, and records that claim it as a worker,
written straight into Redis as a process that can write Redis but lacks the cluster secret would;
and a way into a running ``baton up``'s Redis, with the password its services hold."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.index import keys
from baton.common.index.auth import with_credentials
from baton.common.index.client import RedisClientConfig, connect
from baton.common.index.registry import WorkerInfo
from tests.e2e.up_process import worker_pids


class _Recorder(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def intercept_service(self, continuation, handler_call_details):
        self.calls.append(handler_call_details.method)
        return continuation(handler_call_details)


@contextlib.contextmanager
def recording_server() -> Iterator[tuple[str, list[str]]]:
    """``(address, calls)``: a gRPC server that says SERVING to health checks and appends the
    method of every call it receives (health checks included) to ``calls``."""
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[recorder])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", recorder.calls
    finally:
        server.stop(0)


def forged(worker_id: str, role: str, address: str) -> WorkerInfo:
    """A record that would win every routing choice: idle, all blocks free, an id sorting first."""
    load = {"num_running": 0.0, "num_waiting": 0.0, "free_blocks": 1e9, "queued_prefill_tokens": 0.0}
    return WorkerInfo(
        id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=address,
        kv_address="",
        metrics_url=f"http://{address}/metrics",
        load=load,
    )


def write_forgeries(client, model: str, address: str) -> list[str]:
    """Write, with no TTL, the records an attacker without the secret can make, all pointing at
    ``address``: an unsigned decode and prefill worker, and a real worker's signed record copied
    under a new id with its address changed (its MAC no longer fits). Returns their keys."""
    written = []
    real = next(iter(client.scan_iter(match=keys.worker_pattern(model))), None)
    for worker_id, role in (("0-forged-decode", "decode"), ("0-forged-prefill", "prefill")):
        key = keys.worker_key(model, worker_id)
        client.set(key, forged(worker_id, role, address).to_json())
        written.append(key)
    if real is not None:
        record = json.loads(client.get(real))
        key = keys.worker_key(model, "0-replayed")
        client.set(key, json.dumps({**record, "id": "0-replayed", "grpc_address": address}))
        written.append(key)
    return written


def service_environ(pid: int) -> dict[str, str]:
    """A process's environment, as anyone running as its user can read it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def service_flag(pid: int, flag: str) -> str:
    """The value after ``flag`` on a process's command line."""
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return cmd[cmd.index(flag) + 1]


def gateway_pid(up_pid: int) -> int:
    """The pid of a ``baton up``'s gateway."""
    return next(pid for name, pid in worker_pids(up_pid).items() if name.startswith("gateway"))


def cluster_redis(up_pid: int, authenticated: bool = True, role: str = "decode"):
    """A client of a ``baton up``'s Redis: its URL from the gateway's command line, the Redis user
    and password from the environment of a service of ``role`` (where an attacker on the host, as
    its user, would find them; a worker's user may write the registry, the gateway's only reads)."""
    gateway = gateway_pid(up_pid)
    url = service_flag(gateway, "--redis-url")
    user = password = None
    if authenticated:
        pid = next(pid for name, pid in worker_pids(up_pid).items() if name.startswith(f"{role}-"))
        env = service_environ(pid)
        user, password = env["BATON_REDIS_USERNAME"], env["BATON_REDIS_PASSWORD"]
    # As the services connect (no CLIENT SETINFO, which a role's user may not run: ACL LOG stays theirs).
    return connect(
        with_credentials(url, user, password), RedisClientConfig(socket_timeout_s=5, connect_timeout_s=5)
    )
