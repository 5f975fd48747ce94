"""What ``baton prefill`` and ``baton decode`` share on the command line: their common flags (the
engine's included), the worker config fields those flags make, the parallel-degree checks (``baton
up`` makes them too), and the serving loop that drains on the first signal. Torch-free to import."""

from __future__ import annotations

import argparse
import sys

from baton.common.engine.config_flags import add_emulate_arg, add_engine_args, engine_kwargs
from baton.services import cluster_auth
from baton.services.cli_args import add_drain_args, add_tls_args, grpc_tls


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """Flags every worker takes (engine flags included)."""
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC and metrics servers bind")
    p.add_argument(
        "--advertise-host",
        default="",
        help="address other services reach this worker at (default: --host, or this machine's own "
        "address when --host is 0.0.0.0, as in a container)",
    )
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: pick one)")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--redis-url", default=None, help="registry to join")
    cluster_auth.add_args(p)
    p.add_argument("--worker-id", default="")
    p.add_argument("--kv-transport", default="ucx", choices=["ucx", "nccl"])
    p.add_argument("--cpus", default=None, help="run on these cores only, e.g. 0 or 0-1 (default: all)")
    add_drain_args(p)
    add_tls_args(p)
    add_engine_args(p, dtype="auto")
    add_emulate_arg(p)


def worker_kwargs(a: argparse.Namespace, auth: cluster_auth.ClusterAuth | None = None) -> dict:
    """The config fields a prefill and a decode worker share, from their common flags and ``auth``
    (``cli_args.auth_of``; None: no credentials)."""
    from baton.common.engine.config import EngineConfig
    from baton.common.transfer import TransferConfig
    from baton.services.worker_base import advertised

    auth = auth or cluster_auth.ClusterAuth()
    engine = EngineConfig(**engine_kwargs(a))
    if engine.emulate is not None:  # the profile's block size, chunk and batch, before any use
        from baton.services.emulated import emulated_config

        engine = emulated_config(engine)
    return dict(
        engine=engine,
        host=a.host,
        advertise_host=a.advertise_host,
        grpc_port=a.port,
        metrics_port=a.metrics_port,
        redis_url=auth.url(a.redis_url) if a.redis_url else None,
        cluster_secret=auth.secret,
        worker_id=a.worker_id,
        # The KV transport listens on, and names in its descriptor, the advertised address.
        transfer=TransferConfig(backend=a.kv_transport, host=advertised(a.host, a.advertise_host)),
        grpc_tls=grpc_tls(a),
    )


def _degree(a: argparse.Namespace, flag: str, roles: tuple[str, str]) -> int:
    """The largest of ``a.<flag>`` and ``baton up``'s per-role degrees (the worker commands have none)."""
    return max(getattr(a, flag), *(getattr(a, role, None) or 1 for role in roles))


def bad_tensor_parallel(a: argparse.Namespace, moves_kv: bool) -> int | None:
    """Exit code 2 for a tensor- or pipeline-parallel worker that would move KV over nccl:
    re-sharded transfers (each rank its own layers and heads) run over ucx. And for any worker
    given data-parallel replicas: a worker serves one engine (run more workers instead)."""
    if a.data_parallel_size > 1:
        print(
            "error: --data-parallel-size > 1 runs offline only for now (baton generate, baton bench"
            " offline): a worker serves one engine; run more workers, which the gateway spreads load over",
            file=sys.stderr,
        )
        return 2
    tp = _degree(a, "tensor_parallel_size", ("prefill_tp", "decode_tp"))
    pp = _degree(a, "pipeline_parallel_size", ("prefill_pp", "decode_pp"))
    if (tp > 1 or pp > 1) and moves_kv and a.kv_transport != "ucx":
        print(
            "error: tensor- and pipeline-parallel workers move KV (each rank its own layers and heads)"
            " over --kv-transport ucx only",
            file=sys.stderr,
        )
        return 2
    return None


def serve_forever(serve_until) -> int:
    """Run a worker, ``serve_until(stop)``, to its exit code. The first SIGINT or SIGTERM sets
    ``stop`` (the worker drains); a second exits at once. A non-zero code (a dead engine) leaves
    through ``os._exit`` once the output is flushed: no thread stuck on the dead engine or on an
    unreachable Redis may hold up the supervisor's restart."""
    import asyncio
    import logging
    import os
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> int:
        stop = asyncio.Event()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                os._exit(128 + signum)
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        return await serve_until(stop)

    code = asyncio.run(main())
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0
