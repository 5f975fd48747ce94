"""``python -m baton.services.health_probe``: a worker's gRPC health, asked over its own mutual TLS.

The kubelet's ``grpc`` probe speaks plaintext only (Kubernetes' docs: gRPC probes take no TLS or
authentication parameters), and a worker given ``--grpc-tls-ca`` refuses any client without a
certificate from that CA. So a pod with mutual TLS runs this as an ``exec`` probe: inside the pod,
with the pod's own certificate, against the very port that serves traffic, so that a broken or
expired certificate fails the probe as it fails the callers. Exit 0 when the server says SERVING,
1 otherwise. Imports grpc and nothing heavy: it starts every few seconds (~0.1 s of CPU each).
"""

from __future__ import annotations

import argparse
import os
import sys

TLS_FILES = ("tls.crt", "tls.key", "ca.crt")
"""A kubernetes.io/tls Secret's keys as cert-manager writes them: certificate chain, key, CA."""


def check(address: str, tls, timeout_s: float, service: str = "") -> str:
    """The health status name of ``address`` over ``tls`` (a ``GrpcTLS``), or the gRPC error
    code's name when the call fails."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from baton.services.grpc_tls import channel

    async def ask() -> str:
        async with channel(address, tls) as ch:
            try:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    return asyncio.run(ask())


def main(argv: list[str] | None = None) -> int:
    from baton.services.grpc_tls import GrpcTLS

    p = argparse.ArgumentParser(prog="python -m baton.services.health_probe", description=__doc__)
    p.add_argument("--port", type=int, required=True, help="the worker's gRPC port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tls-dir", default=None, help="folder with tls.crt, tls.key and ca.crt; none: plaintext")
    p.add_argument(
        "--server-name",
        default=os.environ.get("GRPC_TLS_SERVER_NAME") or None,
        help="the name the server's certificate is checked against (default: GRPC_TLS_SERVER_NAME)",
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds the call may take")
    a = p.parse_args(argv)
    tls = GrpcTLS()
    if a.tls_dir:
        cert, key, ca = (os.path.join(a.tls_dir, name) for name in TLS_FILES)
        try:
            tls = GrpcTLS(cert, key, ca, a.server_name)
        except ValueError as e:
            print(f"health probe: {e}", file=sys.stderr)
            return 1
    status = check(f"{a.host}:{a.port}", tls, a.timeout)
    if status != "SERVING":
        print(f"health probe: {a.host}:{a.port} {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
