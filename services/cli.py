"""The ``baton`` command: one front for every entry point.

baton build-kernels [--cache-dir DIR]       # compile the CPU kernels ahead of serving
baton generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--json]
baton bench offline --num-prompts 64 --input-len 256 --output-len 128 --seed 0
baton bench latency --input-len 32 --output-len 512
baton bench transfer --tokens 1024,4096,16384 --output-json w5.json
baton bench breakdown --runs 3 -- --colocated    # where a served token's time goes
baton bench goodput --base-url http://127.0.0.1:8000 --rates 0.25,0.5,1   # W2 goodput: a rate search
baton bench serve --base-url http://127.0.0.1:8000 --workload w2 --request-rate 1 --goodput ttft:1500 tpot:60
baton profile --output P.json [--quick] | --check P.json    # this machine's costs, for the planner
baton plan --profile P.json --rate 20 --slo ttft:2000 tpot:100 --max-workers 16 --json > plan.json
baton up --plan plan.json | --layout 2p3d | --layout colocated:2   # a layout baton plan/simulate named
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from baton.env import API_KEY, KERNEL_CACHE
from baton.kernels import kv_cache_dtypes
from baton.planner.cli import add_simulate_parser
from baton.planner.plan_cli import add_plan_parser
from baton.services import cluster_auth
from baton.services.autoscaler import add_autoscaler_parser
from baton.services.up_autoscale import add_up_autoscale_args, up_autoscale_from_args


def _engine_args(p: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    """Engine flags; ``dtype`` is the default of ``--dtype`` (``auto``: the faster on this CPU)."""
    p.add_argument("--model", default=None, help="a .gguf file or a Llama safetensors directory")
    p.add_argument(
        "--dtype",
        default=dtype,
        choices=["auto", "bfloat16", "float32"],
        help=f"compute dtype; auto: whichever runs the model's GEMMs faster on this CPU (default {dtype})",
    )
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache memory budget")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on cuda, size the KV cache instead as this fraction (0, 1] of the GPU's memory less what"
        " is in use once the model is loaded, as vLLM does (default: off, --kv-cache-gib)",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:N) to run on a GPU (default cpu)")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(kv_cache_dtypes.CHOICES),
        help="KV cache storage: auto (the model dtype) or 1-byte codes with a scale per token and head (fp8: fp8_e4m3, as in vLLM)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "fp8"],
        help="weights: int8 (W8A8, dynamic per-token activations) or fp8 (e4m3), quantized at load",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt + max_tokens beyond it is refused (default: the model's)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--cascade",
        default="auto",
        choices=["auto", "off"],
        help="cascade attention for decode batches sharing a prefix: auto (a cost model decides per step) or off",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="most requests waiting to run; past it a worker refuses new ones (HTTP 429)",
    )
    p.add_argument(
        "--max-waiting-tokens",
        type=int,
        default=262_144,
        help="most tokens the waiting requests may still have to compute; past it new ones are refused",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks (processes of this command) the model's heads and MLP are split across (default 1)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="stages (of --tensor-parallel-size ranks each) the model's layers are split into (default 1)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: place whole experts across the tensor- or data-parallel ranks instead of splitting each",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each with its own scheduler, KV cache and CPUs (offline commands; default 1)",
    )
    _spec_args(p)


def _spec_args(p: argparse.ArgumentParser) -> None:
    """Multi-token step flags: speculative decoding (vLLM's ``prompt_lookup_min/max`` spelled both
    ways) and jump-forward (vLLM has none; on by default, as in SGLang)."""
    p.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft"],
        help="speculative decoding: ngram (prompt lookup) or draft (--draft-model); decode workers only",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="most tokens proposed per step")
    p.add_argument("--ngram-min", "--prompt-lookup-min", dest="ngram_min", type=int, default=2)
    p.add_argument("--ngram-max", "--prompt-lookup-max", dest="ngram_max", type=int, default=4)
    p.add_argument("--draft-model", default=None, help="a smaller Llama, same tokenizer (for draft)")
    p.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="always propose --num-speculative-tokens, even where the step cost says it does not pay",
    )
    p.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="structured outputs: sample every token, even where the grammar forces the continuation",
    )


def _worker_args(p: argparse.ArgumentParser) -> None:
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
    _drain_args(p)
    _tls_args(p)
    _engine_args(p, dtype="auto")
    _emulate_arg(p)


def _emulate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--emulate",
        default=None,
        metavar="PROFILE",
        help="an emulated worker: no model runs, each step sleeps the time this `baton profile` JSON"
        " predicts (the real services, scheduler, KV books and transfers; its figures are labelled emulated)",
    )


def _tls_args(p: argparse.ArgumentParser) -> None:
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


def _tls(a: argparse.Namespace):
    """The ``GrpcTLS`` of ``a``'s flags (ValueError for a bad combination or a missing file)."""
    from baton.services.grpc_tls import GrpcTLS

    return GrpcTLS(a.grpc_tls_cert, a.grpc_tls_key, a.grpc_tls_ca, a.grpc_tls_server_name)


def _bad_tls(a: argparse.Namespace) -> int | None:
    """2 (after saying why) when ``a``'s TLS flags cannot work, else None."""
    try:
        _tls(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return None


def _tls_flags(a: argparse.Namespace) -> list[str]:
    """``a``'s TLS flags, for a child's command line (paths only: no secret is on it)."""
    flags = []
    for name in ("cert", "key", "ca"):
        value = getattr(a, f"grpc_tls_{name}")
        if value:
            flags += [f"--grpc-tls-{name}", os.path.abspath(value)]
    if a.grpc_tls_server_name:
        flags += ["--grpc-tls-server-name", a.grpc_tls_server_name]
    return flags


def _pin(a: argparse.Namespace, torch_threads: bool = True) -> int | None:
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


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        model=a.model,
        dtype=a.dtype,
        kv_cache_gib=a.kv_cache_gib,
        gpu_memory_utilization=a.gpu_memory_utilization,
        device=a.device,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        block_size=a.block_size,
        enable_prefix_caching=not a.no_prefix_caching,
        cascade=a.cascade,
        max_waiting_requests=a.max_waiting_requests,
        max_waiting_tokens=a.max_waiting_tokens,
        max_model_len=a.max_model_len,
        speculative=a.speculative,
        num_speculative_tokens=a.num_speculative_tokens,
        ngram_min=a.ngram_min,
        ngram_max=a.ngram_max,
        draft_model=a.draft_model,
        adaptive_speculation=not a.no_adaptive_speculation,
        jump_forward=not a.no_jump_forward,
        tensor_parallel_size=a.tensor_parallel_size,
        pipeline_parallel_size=a.pipeline_parallel_size,
        enable_expert_parallel=a.enable_expert_parallel,
        data_parallel_size=a.data_parallel_size,
    )


def cmd_build_kernels(a: argparse.Namespace) -> int:
    """Compile the CPU kernels into the cache ahead of serving (``make install`` builds this CPU's
    own, an image's builder every portable level); a second run finds each build and only says so."""
    import time
    from pathlib import Path

    from baton.kernels import cpu_ops, isa

    root = Path(a.cache_dir) if a.cache_dir else cpu_ops.cache_root()
    try:
        levels = isa.parse(a.isa)
    except ValueError as e:
        print(f"error: --isa: {e}", file=sys.stderr)
        return 2
    for level in levels:
        fresh = not cpu_ops.is_built(root, level)
        start = time.perf_counter()
        try:
            lib = cpu_ops.build(root, level)
            if level == isa.NATIVE:
                cpu_ops.load(root)  # this CPU's build must also import here
        except (RuntimeError, OSError, ImportError) as e:  # no compiler or ninja, or the build failed
            where = cpu_ops.build_dir(root, level)
            print(f"error: could not build the CPU kernels into {where}: {e}", file=sys.stderr)
            return 1
        verb = "built" if fresh else "already built"
        print(f"CPU kernels {verb}: {lib} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_secrets(a: argparse.Namespace) -> int:
    """Make the cluster's shared secrets under a folder, keeping any already there."""
    from pathlib import Path

    from baton.services import secrets

    written = secrets.init(Path(a.directory))
    print(f"secrets in {a.directory}: " + (f"wrote {', '.join(written)}" if written else "all there, kept"))
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from baton.common.llm import LLM, SamplingParams

    try:
        params = SamplingParams(
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            max_tokens=a.max_tokens,
            seed=a.seed,
            stop=tuple(a.stop or ()),
            ignore_eos=a.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM(progress=not a.json, **_engine_kwargs(a))
    try:
        if a.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in a.prompt], params)
        else:
            outs = llm.generate(list(a.prompt), params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outs:
        c = out.outputs[0]
        if a.json:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
        else:
            print(c.text)
    return 0


def cmd_quantize(a: argparse.Namespace) -> int:
    from baton.common.model.quantize import write_checkpoint

    write_checkpoint(a.model, a.quantization, a.dtype, a.out_dir)
    print(f"wrote {a.quantization} weights to {a.out_dir}")
    return 0


def _emit(result: dict, output_json: str | None) -> None:
    """Print a benchmark's JSON line, and write it to ``output_json`` when given."""
    line = json.dumps(result)
    print(line)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def cmd_bench_offline(a: argparse.Namespace) -> int:
    from baton.bench.offline import run_offline_bench

    result = run_offline_bench(
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        seed=a.seed,
        engine_kwargs=_engine_kwargs(a),
    )
    _emit(result, a.output_json)
    return 0


def cmd_bench_latency(a: argparse.Namespace) -> int:
    from baton.bench.offline import run_latency_bench

    result = run_latency_bench(a.input_len, a.output_len, a.seed, _engine_kwargs(a))
    _emit(result, a.output_json)
    return 0


def _drain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before ending the rest (a second "
        "SIGTERM exits at once)",
    )


def _serve_forever(serve_until) -> int:
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


def _cluster_auth(a: argparse.Namespace):
    """``a``'s Redis credentials and cluster secret, with the environment's (read here, once); None,
    having said why, when a secret file cannot be read."""
    try:
        return cluster_auth.from_args(a, os.environ)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def _worker_kwargs(a: argparse.Namespace, auth: cluster_auth.ClusterAuth | None = None) -> dict:
    """The config fields a prefill and a decode worker share, from their common flags and ``auth``
    (``_cluster_auth``; None: no credentials)."""
    from baton.common.engine.config import EngineConfig
    from baton.common.transfer import TransferConfig
    from baton.services.worker_base import advertised

    auth = auth or cluster_auth.ClusterAuth()
    engine = EngineConfig(**_engine_kwargs(a), emulate=a.emulate)
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
        grpc_tls=_tls(a),
    )


def _degree(a: argparse.Namespace, flag: str, roles: tuple[str, str]) -> int:
    """The largest of ``a.<flag>`` and ``baton up``'s per-role degrees (the worker commands have none)."""
    return max(getattr(a, flag), *(getattr(a, role, None) or 1 for role in roles))


def _bad_tensor_parallel(a: argparse.Namespace, moves_kv: bool) -> int | None:
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


def cmd_decode(a: argparse.Namespace) -> int:
    from baton.services.decode.worker import DecodeWorkerConfig, serve
    from baton.services.pod_cost import pod_from_env

    if (code := _bad_tls(a) or _pin(a) or _bad_tensor_parallel(a, not a.colocated)) is not None:
        return code
    if (auth := _cluster_auth(a)) is None:
        return 2
    config = DecodeWorkerConfig(
        **_worker_kwargs(a, auth),
        remote_prefill_threshold=a.remote_prefill_threshold,
        colocated=a.colocated,
        pod=pod_from_env(os.environ),
    )
    return _serve_forever(lambda stop: serve(config, stop, a.drain_timeout))


def cmd_prefill(a: argparse.Namespace) -> int:
    from baton.services.prefill.worker import PrefillWorkerConfig, serve

    if (code := _bad_tls(a) or _pin(a)) is not None:
        return code
    if (code := _bad_tensor_parallel(a, moves_kv=True)) is not None:
        return code
    if (auth := _cluster_auth(a)) is None:
        return 2
    a.speculative = None  # a prefill worker returns the first token only: nothing to speculate
    config = PrefillWorkerConfig(
        **_worker_kwargs(a, auth),
        fault_pause_after_blocks=a.fault_pause_after_blocks,
        fault_hold_payload_after_blocks=a.fault_hold_payload_after_blocks,
    )
    return _serve_forever(lambda stop: serve(config, stop, a.drain_timeout))


def _front_door_args(p: argparse.ArgumentParser) -> None:
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


def _front_door(a: argparse.Namespace) -> dict | None:
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


def cmd_gateway(a: argparse.Namespace) -> int:
    from baton.services.gateway.app import GatewayConfig

    if (code := _bad_tls(a) or _pin(a, torch_threads=False)) is not None:
        return code
    if (front := _front_door(a)) is None or (auth := _cluster_auth(a)) is None:
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
        grpc_tls=_tls(a),
    )
    return _serve_gateway(config)


def _migration_args(p: argparse.ArgumentParser) -> None:
    """The gateway's request-migration flags (``baton gateway`` and ``baton up``)."""
    p.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times a request may resume on another decode worker when its own fails mid-stream",
    )
    p.add_argument(
        "--stream-progress-timeout",
        type=float,
        default=10.0,
        help="seconds a started stream may go without a token before its worker counts as hung",
    )


def _gateway_flags(a: argparse.Namespace) -> list[str]:
    """The gateway options of ``baton up``'s flags, for its gateway's command line."""
    return [
        "--max-migrations",
        str(a.max_migrations),
        "--stream-progress-timeout",
        str(a.stream_progress_timeout),
    ]


def cmd_up(a: argparse.Namespace) -> int:
    from baton.services.up import UpConfig, run_cluster

    if not apply_up_layout(a):
        return 2
    if (code := _bad_tls(a) or _bad_tensor_parallel(a, not a.colocated)) is not None:
        return code
    if (front := _front_door(a)) is None or (auth := _cluster_auth(a)) is None:
        return 2
    if a.emulate and (code := _emulated_up(a)) is not None:
        return code
    try:
        autoscale = up_autoscale_from_args(a)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton up --autoscale: {e}", file=sys.stderr)
        return 2
    return run_cluster(
        UpConfig(
            prefill=a.prefill,
            decode=a.decode,
            dtype=a.dtype,
            kv_transport=a.kv_transport,
            host=a.host,
            port=a.port,
            engine_args=_engine_flags(a),
            gateway_args=_gateway_flags(a),
            tls_args=_tls_flags(a),
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


def _engine_flags(a: argparse.Namespace) -> list[str]:
    """The engine options of ``a`` as command-line flags, to pass on to a worker process (but the
    dtype, which ``baton up`` resolves first)."""
    flags = ["--kv-cache-gib", str(a.kv_cache_gib), "--kv-cache-dtype", a.kv_cache_dtype]
    flags += ["--device", a.device] if a.device != "cpu" else []
    u = a.gpu_memory_utilization
    flags += ["--gpu-memory-utilization", str(u)] if u is not None else []
    flags += ["--quantization", a.quantization] if a.quantization else []
    flags += [
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--max-num-seqs",
        str(a.max_num_seqs),
    ]
    flags += ["--block-size", str(a.block_size)]
    flags += ["--max-waiting-requests", str(a.max_waiting_requests)]
    flags += ["--max-waiting-tokens", str(a.max_waiting_tokens)]
    if a.model:
        flags += ["--model", a.model]
    if a.no_prefix_caching:
        flags.append("--no-prefix-caching")
    flags += ["--cascade", a.cascade]
    flags += ["--tensor-parallel-size", str(a.tensor_parallel_size)] if a.tensor_parallel_size > 1 else []
    flags += (
        ["--pipeline-parallel-size", str(a.pipeline_parallel_size)] if a.pipeline_parallel_size > 1 else []
    )
    flags += ["--enable-expert-parallel"] if a.enable_expert_parallel else []
    if a.max_model_len is not None:
        flags += ["--max-model-len", str(a.max_model_len)]
    if a.speculative:
        flags += ["--speculative", a.speculative, "--num-speculative-tokens", str(a.num_speculative_tokens)]
        flags += ["--ngram-min", str(a.ngram_min), "--ngram-max", str(a.ngram_max)]
        flags += ["--draft-model", os.path.abspath(a.draft_model)] if a.draft_model else []
        flags += ["--no-adaptive-speculation"] if a.no_adaptive_speculation else []
    flags += ["--no-jump-forward"] if a.no_jump_forward else []
    emulate = getattr(a, "emulate", None)  # baton up's and the workers' flag; generate has none
    flags += ["--emulate", os.path.abspath(emulate)] if emulate else []
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description="LLM serving with disaggregated prefill and decode"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)  # baton simulate (planner/cli.py)
    add_plan_parser(sub)  # baton plan (planner/plan_cli.py)
    add_autoscaler_parser(sub)  # baton autoscaler (services/autoscaler.py)

    g = sub.add_parser("generate", help="generate offline with the engine")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--chat", action="store_true", help="apply the chat template (each prompt is a user turn)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids"} per prompt')
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    qz = sub.add_parser("quantize", help="write a quantized compressed-tensors checkpoint directory")
    qz.add_argument("out_dir", help="the directory to write (safetensors, config.json, tokenizer)")
    qz.add_argument("--model", default=None, help="a .gguf file or a Llama safetensors directory")
    qz.add_argument("--quantization", required=True, choices=["int8", "fp8"])
    qz.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the other weights"
    )
    qz.set_defaults(func=cmd_quantize)

    bk = sub.add_parser("build-kernels", help="compile the CPU kernels into the cache, ahead of serving")
    bk.add_argument(
        "--cache-dir",
        default=None,
        help=f"build under this folder (default: {KERNEL_CACHE.name}, else ~/.cache/baton/kernels)",
    )
    bk.add_argument(
        "--isa",
        default="native",
        help="native (this CPU's own, the default), all, or a comma-separated list of portable x86 "
        "levels (amx, avx512-bf16, avx2): an image builds all, and a process imports the best its CPU runs",
    )
    bk.set_defaults(func=cmd_build_kernels)

    sec = sub.add_parser(
        "secrets",
        help="make a cluster's Redis password, record key and internal TLS identity (compose runs it)",
    )
    sec.add_argument("directory", help="where to write them; files already there are kept")
    sec.set_defaults(func=cmd_secrets)

    up = sub.add_parser("up", help="a local cluster: Redis, decode workers and the gateway")
    up.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers (0: decode workers prefill; default: decided from this machine's cores and "
        "speed, printed at start)",
    )
    up.add_argument("--decode", type=int, default=1, help="decode workers")
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
    _drain_args(up)
    up.add_argument(
        "--colocated",
        action="store_true",
        help="decode workers prefill too: no prefill workers, no KV transfer",
    )
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
    up.add_argument(
        "--cpus",
        default=None,
        help="pin workers to cores: 'auto' (share them out), 'none', or one cpu list per worker, prefill "
        "workers first, e.g. '0|1' (default: as the layout decides)",
    )
    up.add_argument(
        "--layout",
        default=None,
        help="the workers as `baton simulate`/`baton plan` name them: <N>p<M>d (N prefill and M decode "
        "workers) or colocated[:N] (N decode workers that prefill, no prefill pool); instead of "
        "--prefill/--decode/--colocated",
    )
    up.add_argument("--plan", default=None, help="apply the layout of a `baton plan --json` output file")
    add_up_autoscale_args(up)  # --autoscale (services/up_autoscale.py)
    _engine_args(up, dtype="auto")
    _emulate_arg(up)
    cluster_auth.add_args(up)
    _front_door_args(up)
    _migration_args(up)
    _tls_args(up)
    up.set_defaults(func=cmd_up)

    dec = sub.add_parser("decode", help="one decode worker")
    _worker_args(dec)
    dec.add_argument(
        "--remote-prefill-threshold", type=int, default=32, help="fewer uncached prompt tokens: prefill here"
    )
    dec.add_argument("--colocated", action="store_true", help="prefill every prompt here (never remotely)")
    dec.set_defaults(func=cmd_decode)

    pre = sub.add_parser("prefill", help="one prefill worker")
    _worker_args(pre)
    # Test-only fault injection (tests/e2e/test_faults_prefill.py), hidden from --help: the engine
    # stops for good once the first prompt has had N blocks sent, as a worker dying mid-transfer;
    # or each prompt's KV stops in the middle of a message after N blocks, as one dying mid-message.
    pre.add_argument("--fault-pause-after-blocks", type=int, default=0, help=argparse.SUPPRESS)
    pre.add_argument("--fault-hold-payload-after-blocks", type=int, default=0, help=argparse.SUPPRESS)
    pre.set_defaults(func=cmd_prefill)

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
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
    _drain_args(gw)
    _front_door_args(gw)
    _migration_args(gw)
    _tls_args(gw)
    gw.set_defaults(func=cmd_gateway)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    off = bench.add_parser("offline", help="W1: offline throughput of the engine")
    off.add_argument("--num-prompts", type=int, default=64)
    off.add_argument("--input-len", type=int, default=256)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--output-json", default=None)
    _engine_args(off)
    off.set_defaults(func=cmd_bench_offline)
    lat = bench.add_parser("latency", help="batch-1 decode time per output token")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=512)
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--output-json", default=None)
    _engine_args(lat)
    lat.set_defaults(func=cmd_bench_latency)
    from baton.bench import breakdown as bench_breakdown
    from baton.bench import gateway as bench_gateway
    from baton.bench import goodput as bench_goodput
    from baton.bench import kv_step as bench_kv_step
    from baton.bench import serve as bench_serve
    from baton.bench import transfer as bench_transfer

    bench_serve.register(bench)
    bench_transfer.register(bench)
    bench_breakdown.register(bench)
    bench_goodput.register(bench)
    bench_gateway.register(bench)
    bench_kv_step.register(bench)
    from baton.bench import accuracy as bench_accuracy

    bench_accuracy.register(bench)
    from baton.bench import roofline as bench_roofline

    bench_roofline.register(bench)
    from baton.bench import profile as bench_profile

    bench_profile.register(sub, _engine_args, _engine_kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if (code := _bad_gpu_memory_utilization(a)) is not None:
        return code
    return a.func(a)


def _bad_gpu_memory_utilization(a: argparse.Namespace) -> int | None:
    """2 (after saying why) for ``--gpu-memory-utilization`` out of (0, 1] or off a GPU, before
    ``baton up`` starts workers that would each refuse it."""
    if getattr(a, "gpu_memory_utilization", None) is None:
        return None
    from baton.common.engine.kv_budget import check_gpu_memory_utilization

    try:
        check_gpu_memory_utilization(a.gpu_memory_utilization, a.device, a.data_parallel_size)
    except ValueError as e:
        print(f"error: --gpu-memory-utilization: {e}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
