"""Subcommands that are no service: ``baton generate`` and ``quantize`` (the offline engine),
``build-kernels`` and ``secrets`` (set-up)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from baton.common.engine.config_flags import add_engine_args, engine_kwargs
from baton.env import KERNEL_CACHE


def register(subparsers) -> None:
    _register_generate(subparsers)
    qz = subparsers.add_parser("quantize", help="write a quantized compressed-tensors checkpoint directory")
    qz.add_argument("out_dir", help="the directory to write (safetensors, config.json, tokenizer)")
    qz.add_argument("--model", default=None, help="a .gguf file or a Llama safetensors directory")
    qz.add_argument("--quantization", required=True, choices=["int8", "fp8"])
    qz.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the other weights"
    )
    qz.set_defaults(func=cmd_quantize)
    _register_build_kernels(subparsers)
    sec = subparsers.add_parser(
        "secrets",
        help="make a cluster's Redis password, record key and internal TLS identity (compose runs it)",
    )
    sec.add_argument("directory", help="where to write them; files already there are kept")
    sec.set_defaults(func=cmd_secrets)


def _register_generate(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate offline with the engine")
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
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def _register_build_kernels(subparsers) -> None:
    bk = subparsers.add_parser(
        "build-kernels", help="compile the CPU kernels into the cache, ahead of serving"
    )
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
    bk.add_argument(
        "--check",
        action="store_true",
        help="only check that each level compiles and links (-O0, in a temporary folder; nothing is "
        "kept or imported): a level this CPU cannot run too",
    )
    bk.set_defaults(func=cmd_build_kernels)


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
    if a.check:
        return _check_kernels(levels)
    for level in levels:
        fresh = not cpu_ops.is_built(root, level)
        start = time.perf_counter()
        try:
            lib = cpu_ops.build(root, level)
            if level == isa.NATIVE:
                cpu_ops.load(root)  # this CPU's build must also import here
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
            # no compiler or ninja (torch asks `$CXX --version` first), or the build failed
            where = cpu_ops.build_dir(root, level)
            print(f"error: could not build the CPU kernels into {where}: {e}", file=sys.stderr)
            return 1
        verb = "built" if fresh else "already built"
        print(f"CPU kernels {verb}: {lib} ({time.perf_counter() - start:.1f} s)")
    return 0


def _check_kernels(levels: list[str]) -> int:
    """``build-kernels --check``: compile and link each level at -O0, keep nothing."""
    import time

    from baton.kernels import cpu_ops

    for level in levels:
        start = time.perf_counter()
        try:
            cpu_ops.check(level)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"error: the CPU kernels do not build for {level}: {e}", file=sys.stderr)
            return 1
        print(f"CPU kernels compile for {level} ({time.perf_counter() - start:.1f} s, nothing kept)")
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
    llm = LLM(progress=not a.json, **engine_kwargs(a))
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
