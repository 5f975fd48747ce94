"""``baton prefill``: one prefill worker (``services/prefill/worker.py``) from its flags."""

from __future__ import annotations

import argparse

from baton.services.cli_args import auth_of, bad_tls, pin
from baton.services.worker_cli import add_worker_args, bad_tensor_parallel, serve_forever, worker_kwargs


def register(subparsers) -> None:
    pre = subparsers.add_parser("prefill", help="one prefill worker")
    add_worker_args(pre)
    # Test-only fault injection (tests/e2e/test_faults_prefill.py), hidden from --help: the engine
    # stops for good once the first prompt has had N blocks sent, as a worker dying mid-transfer;
    # or each prompt's KV stops in the middle of a message after N blocks, as one dying mid-message.
    pre.add_argument("--fault-pause-after-blocks", type=int, default=0, help=argparse.SUPPRESS)
    pre.add_argument("--fault-hold-payload-after-blocks", type=int, default=0, help=argparse.SUPPRESS)
    pre.set_defaults(func=cmd_prefill)


def cmd_prefill(a: argparse.Namespace) -> int:
    from baton.services.prefill.worker import PrefillWorkerConfig, serve

    if (code := bad_tls(a) or pin(a)) is not None:
        return code
    if (code := bad_tensor_parallel(a, moves_kv=True)) is not None:
        return code
    if (auth := auth_of(a)) is None:
        return 2
    a.speculative = None  # a prefill worker returns the first token only: nothing to speculate
    config = PrefillWorkerConfig(
        **worker_kwargs(a, auth),
        fault_pause_after_blocks=a.fault_pause_after_blocks,
        fault_hold_payload_after_blocks=a.fault_hold_payload_after_blocks,
    )
    return serve_forever(lambda stop: serve(config, stop, a.drain_timeout))
