"""``baton decode``: one decode worker (``services/decode/worker.py``) from its flags."""

from __future__ import annotations

import argparse
import os

from baton.services.cli_args import auth_of, bad_tls, pin
from baton.services.worker_cli import add_worker_args, bad_tensor_parallel, serve_forever, worker_kwargs


def register(subparsers) -> None:
    dec = subparsers.add_parser("decode", help="one decode worker")
    add_worker_args(dec)
    dec.add_argument(
        "--remote-prefill-threshold", type=int, default=32, help="fewer uncached prompt tokens: prefill here"
    )
    dec.add_argument("--colocated", action="store_true", help="prefill every prompt here (never remotely)")
    dec.set_defaults(func=cmd_decode)


def cmd_decode(a: argparse.Namespace) -> int:
    from baton.services.decode.worker import DecodeWorkerConfig, serve
    from baton.services.pod_cost import pod_from_env

    if (code := bad_tls(a) or pin(a) or bad_tensor_parallel(a, not a.colocated)) is not None:
        return code
    if (auth := auth_of(a)) is None:
        return 2
    config = DecodeWorkerConfig(
        **worker_kwargs(a, auth),
        remote_prefill_threshold=a.remote_prefill_threshold,
        colocated=a.colocated,
        pod=pod_from_env(os.environ),
    )
    return serve_forever(lambda stop: serve(config, stop, a.drain_timeout))
