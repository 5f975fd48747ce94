"""``baton up``: a local cluster (``services/up.py``) from its flags; ``--layout`` and ``--plan``
name its workers as ``baton simulate``/``baton plan`` do, ``--emulate`` runs it without a model."""

from __future__ import annotations

import argparse
import sys

from baton.common.engine.config_flags import add_emulate_arg, add_engine_args, engine_flags
from baton.services import cluster_auth
from baton.services.cli_args import (
    add_drain_args,
    add_front_door_args,
    add_migration_args,
    add_tls_args,
    auth_of,
    bad_tls,
    front_door,
    gateway_flags,
    tls_flags,
)
from baton.services.up_autoscale import add_up_autoscale_args, up_autoscale_from_args
from baton.services.worker_cli import bad_tensor_parallel


def register(subparsers) -> None:
    up = subparsers.add_parser("up", help="a local cluster: Redis, decode workers and the gateway")
    _add_pool_args(up)
    up.add_argument("--kv-transport", default="ucx", choices=["ucx", "nccl"])
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000, help="the gateway's port")
    up.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    up.add_argument("--log-dir", default=None, help="write each service's output here (default: inherit)")
    up.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="port of the supervisor's /metrics (baton:service_restarts_total; default: a free one, printed)",
    )
    add_drain_args(up)
    _add_degree_args(up)
    up.add_argument(
        "--cpus",
        default=None,
        help="pin workers to cores: 'auto' (share them out), 'none', or one cpu list per worker, prefill "
        "workers first, e.g. '0|1' (default: as the layout decides)",
    )
    add_up_autoscale_args(up)  # --autoscale (services/up_autoscale.py)
    add_engine_args(up, dtype="auto")
    add_emulate_arg(up)
    cluster_auth.add_args(up)
    add_front_door_args(up)
    add_migration_args(up)
    add_tls_args(up)
    up.set_defaults(func=cmd_up)


def _add_pool_args(up: argparse.ArgumentParser) -> None:
    """How many workers of each kind: counted, or a layout or plan that names them."""
    up.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers (0: decode workers prefill; default: decided from this machine's cores and "
        "speed, printed at start)",
    )
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument(
        "--colocated",
        action="store_true",
        help="decode workers prefill too: no prefill workers, no KV transfer",
    )
    up.add_argument(
        "--layout",
        default=None,
        help="the workers as `baton simulate`/`baton plan` name them: <N>p<M>d (N prefill and M decode "
        "workers) or colocated[:N] (N decode workers that prefill, no prefill pool); instead of "
        "--prefill/--decode/--colocated",
    )
    up.add_argument("--plan", default=None, help="apply the layout of a `baton plan --json` output file")


def _add_degree_args(up: argparse.ArgumentParser) -> None:
    """Each role's parallel degrees, where they differ from the engine flags'."""
    up.add_argument(
        "--prefill-tp",
        type=int,
        default=None,
        help="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size)",
    )
    up.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="tensor-parallel ranks of each decode worker (default: --tensor-parallel-size); the KV is "
        "re-sharded in transfer where the two differ",
    )
    up.add_argument(
        "--prefill-pp",
        type=int,
        default=None,
        help="pipeline stages of each prefill worker (default: --pipeline-parallel-size)",
    )
    up.add_argument(
        "--decode-pp",
        type=int,
        default=None,
        help="pipeline stages of each decode worker (default: --pipeline-parallel-size); the KV is "
        "re-sharded by layers in transfer where the two differ",
    )


def cmd_up(a: argparse.Namespace) -> int:
    from baton.services.up import run_cluster

    if not apply_up_layout(a):
        return 2
    if (code := bad_tls(a) or bad_tensor_parallel(a, not a.colocated)) is not None:
        return code
    if (front := front_door(a)) is None or (auth := auth_of(a)) is None:
        return 2
    if a.emulate and (code := _emulated_up(a)) is not None:
        return code
    try:
        autoscale = up_autoscale_from_args(a)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton up --autoscale: {e}", file=sys.stderr)
        return 2
    return run_cluster(_up_config(a, auth, autoscale, front))


def _up_config(a: argparse.Namespace, auth, autoscale, front: dict):
    """The ``UpConfig`` of ``baton up``'s checked flags."""
    from baton.services.up import UpConfig

    return UpConfig(
        prefill=a.prefill,
        decode=a.decode,
        dtype=a.dtype,
        kv_transport=a.kv_transport,
        host=a.host,
        port=a.port,
        engine_args=engine_flags(a),
        gateway_args=gateway_flags(a),
        tls_args=tls_flags(a),
        model=a.model,
        ready_timeout_s=a.ready_timeout,
        block_size=a.block_size,
        log_dir=a.log_dir,
        colocated=a.colocated,
        prefill_tp=a.prefill_tp or a.tensor_parallel_size,
        decode_tp=a.decode_tp or a.tensor_parallel_size,
        prefill_pp=a.prefill_pp or a.pipeline_parallel_size,
        decode_pp=a.decode_pp or a.pipeline_parallel_size,
        cpus=a.cpus,
        drain_timeout_s=a.drain_timeout,
        metrics_port=a.metrics_port,
        auth=auth,
        autoscale=autoscale,
        **front,
    )


def apply_up_layout(a: argparse.Namespace) -> bool:
    """``baton up --layout L`` or ``--plan P.json`` (a ``baton plan --json`` output): the worker
    counts they name, set as ``--prefill``/``--decode``/``--colocated`` would (so the rest of ``up``
    sees one way of asking), and the plan's chunk as ``--max-num-batched-tokens``; False, with the
    reason printed, when they cannot be applied."""
    import json
    from pathlib import Path

    from baton.services.layout import fixed_layout, plan_layout

    if not (a.layout or a.plan):
        return True
    if (a.layout and a.plan) or a.prefill is not None or a.colocated or a.decode != 1:
        print("error: set the workers by one of --layout, --plan or --prefill/--decode/--colocated",
              file=sys.stderr)  # fmt: skip
        return False
    try:
        if a.layout:
            text, chunk, warning = a.layout, None, None
        else:
            text, chunk, warning = plan_layout(json.loads(Path(a.plan).read_text()))
        a.prefill, a.decode, a.colocated = fixed_layout(text)
    except (OSError, ValueError) as e:
        print(f"error: {'--layout' if a.layout else '--plan ' + a.plan}: {e}", file=sys.stderr)
        return False
    if chunk is not None:  # the step mix the plan was simulated with
        a.max_num_batched_tokens = chunk
        print(f"baton up: the plan's {text}, chunk {chunk} (--max-num-batched-tokens)", file=sys.stderr)
    if warning:
        print(warning, file=sys.stderr)
    return True


def _emulated_up(a: argparse.Namespace) -> int | None:
    """``baton up --emulate``: the layout is the flags' (this machine's probe says nothing of the
    emulated one), the workers unpinned, the dtype and block size the profile's."""
    from baton.common.engine.config import EngineConfig
    from baton.services.emulated import emulated_config

    if a.prefill is None and not a.colocated:
        print(
            "error: --emulate needs the workers given (--layout, --plan, --prefill N or --colocated):"
            " this machine's probe says nothing of emulated ones",
            file=sys.stderr,
        )
        return 2
    try:
        engine = emulated_config(EngineConfig(block_size=a.block_size, emulate=a.emulate))
    except (OSError, ValueError) as e:
        print(f"error: --emulate {a.emulate}: {e}", file=sys.stderr)
        return 2
    a.dtype, a.block_size, a.cpus = engine.dtype, engine.block_size, a.cpus or "none"
    return None
