"""Flag groups and checks several services' subcommands share (``baton gateway``, ``decode``,
``prefill``, ``up``): internal TLS, core pinning, draining, cluster credentials and the gateway's
front door. Each ``add_*`` declares flags on a parser; the others read them back, printing why and
returning an exit code (or None) where they are unusable. Torch-free to import."""

from __future__ import annotations

import argparse
import os
import sys

from baton.env import API_KEY
from baton.services import cluster_auth


def add_tls_args(p: argparse.ArgumentParser) -> None:
    """TLS for the internal gRPC (every service; ``services/grpc_tls.py``)."""
    p.add_argument(
        "--grpc-tls-cert", default=None, help="PEM certificate chain: serve and call gRPC over TLS"
    )
    p.add_argument("--grpc-tls-key", default=None, help="its PEM private key")
    p.add_argument(
        "--grpc-tls-ca",
        default=None,
        help="PEM CA of the other services: verify them, and require their client certificates (mutual TLS)",
    )
    p.add_argument(
        "--grpc-tls-server-name",
        default=None,
        help="check every server's certificate against this name, not the address dialled (one "
        "certificate shared by services whose addresses are not known in advance, as pods)",
    )


def grpc_tls(a: argparse.Namespace):
    """The ``GrpcTLS`` of ``a``'s flags (ValueError for a bad combination or a missing file)."""
    from baton.services.grpc_tls import GrpcTLS

    return GrpcTLS(a.grpc_tls_cert, a.grpc_tls_key, a.grpc_tls_ca, a.grpc_tls_server_name)


def bad_tls(a: argparse.Namespace) -> int | None:
    """2 (after saying why) when ``a``'s TLS flags cannot work, else None."""
    try:
        grpc_tls(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return None


def tls_flags(a: argparse.Namespace) -> list[str]:
    """``a``'s TLS flags, for a child's command line (paths only: no secret is on it)."""
    flags = []
    for name in ("cert", "key", "ca"):
        value = getattr(a, f"grpc_tls_{name}")
        if value:
            flags += [f"--grpc-tls-{name}", os.path.abspath(value)]
    if a.grpc_tls_server_name:
        flags += ["--grpc-tls-server-name", a.grpc_tls_server_name]
    return flags


def pin(a: argparse.Namespace, torch_threads: bool = True) -> int | None:
    """Apply ``--cpus`` (without it, torch's threads follow the CPU quota); an exit code when it is bad."""
    if a.cpus is None:
        if torch_threads:
            _threads_from_quota()
        return None
    from baton.services.procs import parse_cpu_list, pin_to_cpus

    try:
        pin_to_cpus(parse_cpu_list(a.cpus), torch_threads)
    except (ValueError, OSError) as e:
        print(f"error: --cpus {a.cpus}: {e}", file=sys.stderr)
        return 2
    return None


def _threads_from_quota() -> None:
    """Torch's threads no more than the cgroup's CPU quota allows (a pod's CPU limit): a 2-CPU pod
    on a 64-core node would otherwise start 64 threads and have them throttled."""
    from baton.services.cpu_quota import cpu_quota, quota_threads

    cores = len(os.sched_getaffinity(0))
    threads = quota_threads(cpu_quota(), cores)
    if threads < cores:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def add_drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before ending the rest (a second "
        "SIGTERM exits at once)",
    )


def auth_of(a: argparse.Namespace) -> cluster_auth.ClusterAuth | None:
    """``a``'s Redis credentials and cluster secret, with the environment's (read here, once); None,
    having said why, when a secret file cannot be read."""
    try:
        return cluster_auth.from_args(a, os.environ)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def add_front_door_args(p: argparse.ArgumentParser) -> None:
    """The gateway's front-door flags (``baton gateway`` and ``baton up``)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="a key clients must send as 'Authorization: Bearer KEY' on /v1/* and /workers (repeat for "
        f"several; {API_KEY.name}, comma-separated, adds more and stays out of ps)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=512,
        help="generation requests in flight at once (a stream until it ends); past it, HTTP 429",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=4 * 2**20, help="largest request body; past it, HTTP 413"
    )


def front_door(a: argparse.Namespace) -> dict | None:
    """The gateway's front-door settings from the flags and ``BATON_API_KEY`` (read here, once);
    None, having said why, when one is unusable. Never prints a key."""
    from baton.env import api_keys

    env = api_keys()
    keys = tuple(dict.fromkeys([*(a.api_key or []), *env]))
    if any(not k or not k.isascii() or not k.isprintable() or " " in k or "," in k for k in keys):
        print("error: an API key must be printable ASCII without spaces or commas", file=sys.stderr)
        return None
    if a.max_concurrent_requests < 1 or a.max_body_bytes < 1:
        print("error: --max-concurrent-requests and --max-body-bytes must be at least 1", file=sys.stderr)
        return None
    return dict(
        api_keys=keys, max_concurrent_requests=a.max_concurrent_requests, max_body_bytes=a.max_body_bytes
    )


def add_migration_args(p: argparse.ArgumentParser) -> None:
    """The gateway's request-migration flags (``baton gateway`` and ``baton up``)."""
    p.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times in a row, without a new token, a request may resume on another decode worker when "
        "its own fails mid-stream",
    )
    p.add_argument(
        "--stream-progress-timeout",
        type=float,
        default=10.0,
        help="seconds a started stream may go without a token before its worker counts as hung",
    )


def gateway_flags(a: argparse.Namespace) -> list[str]:
    """The gateway options of ``baton up``'s flags, for its gateway's command line."""
    return [
        "--max-migrations",
        str(a.max_migrations),
        "--stream-progress-timeout",
        str(a.stream_progress_timeout),
    ]
