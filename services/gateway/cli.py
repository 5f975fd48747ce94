"""``baton gateway``: the OpenAI-compatible HTTP gateway (``services/gateway/app.py``) from its flags."""

from __future__ import annotations

import argparse
import sys

from baton.services import cluster_auth
from baton.services.cli_args import (
    add_drain_args,
    add_front_door_args,
    add_migration_args,
    add_tls_args,
    auth_of,
    bad_tls,
    front_door,
    grpc_tls,
    pin,
)


def register(subparsers) -> None:
    gw = subparsers.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--model", default=None)
    gw.add_argument("--redis-url", required=True)
    cluster_auth.add_args(gw)
    gw.add_argument(
        "--expect-prefill",
        type=int,
        default=0,
        metavar="N",
        help="/ready waits until N prefill workers are registered (baton up sets its pool's size)",
    )
    gw.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (prefix routing)")
    gw.add_argument("--cpus", default=None, help="run on these cores only, e.g. 0 (default: all)")
    add_drain_args(gw)
    add_front_door_args(gw)
    add_migration_args(gw)
    add_tls_args(gw)
    gw.set_defaults(func=cmd_gateway)


def cmd_gateway(a: argparse.Namespace) -> int:
    from baton.services.gateway.app import GatewayConfig

    if (code := bad_tls(a) or pin(a, torch_threads=False)) is not None:
        return code
    if (front := front_door(a)) is None or (auth := auth_of(a)) is None:
        return 2
    if a.expect_prefill < 0:
        print("error: --expect-prefill must be at least 0", file=sys.stderr)
        return 2
    config = GatewayConfig(
        **front,
        host=a.host,
        port=a.port,
        model=a.model,
        redis_url=auth.url(a.redis_url),
        cluster_secret=auth.secret,
        expect_prefill=a.expect_prefill,
        block_size=a.block_size,
        max_migrations=a.max_migrations,
        stream_progress_timeout_s=a.stream_progress_timeout,
        drain_timeout_s=a.drain_timeout,
        grpc_tls=grpc_tls(a),
    )
    return _serve_gateway(config)


def _serve_gateway(config) -> int:
    """Run the gateway with uvicorn's own SIGINT/SIGTERM handling: it stops accepting, lets open
    requests and streams finish within ``config.drain_timeout_s``, shuts the app down and exits 0.
    (Cancelling its task instead cut open streams and printed the lifespan's CancelledError.)"""
    import asyncio
    import signal

    from baton.services.gateway.app import make_server

    server = make_server(config)
    # Until uvicorn takes the signals over, and when it re-raises the one it handled, they end up
    # here: a signal during start-up stops it cleanly, and the re-raise exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    asyncio.run(server.serve())
    return 0
