"""Every ``BATON_*`` environment variable Baton reads, declared once: its name, what it sets, its
default. Modules read them through these ``Var`` objects (``CACHE_DIR.get()``), never by spelling
the name; ``tests/unit/test_env_vars.py`` finds no ``BATON_`` name anywhere else in the product.

Read at each call, not at import: a child process inherits what its parent set, and a command
line flag that sets one (``baton build-kernels --cache-dir``) reaches the code that reads it.

Pure: the standard library only, importable from every layer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    """One environment variable."""

    name: str
    help: str
    default: str | None = None

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Its value (an empty one counts as unset), else the default; a default under ``~`` is
        under the home of the moment (``$HOME`` read now, not at import)."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value:
            return value
        return os.path.expanduser(self.default) if self.default else self.default

    @property
    def file(self) -> str:
        """The companion variable naming a file that holds a secret's value (a mounted Secret)."""
        return f"{self.name}_FILE"


CACHE_DIR = Var(
    "BATON_CACHE_DIR", "what is derived from a model once: its tokenizer, its GGUF tensors", "~/.cache/baton"
)
KERNEL_CACHE = Var("BATON_KERNEL_CACHE", "where the built CPU kernels live", "~/.cache/baton/kernels")
KERNEL_ISA = Var("BATON_KERNEL_ISA", "the x86 level of the CPU kernels to load (avx2, avx512bf16, amx...)")
BF16_GEMM = Var(
    "BATON_BF16_GEMM", "bf16 weights' GEMM: auto (ours where AVX512-BF16 built it), baton or onednn", "auto"
)
ONE_CALL_LAYERS = Var(
    "BATON_ONE_CALL_LAYERS",
    "CPU steps run every decoder layer in one C++ call where they can (1) or layer by layer in Python (0)",
    "1",
)
API_KEY = Var("BATON_API_KEY", "the API keys the gateway asks for (comma-separated)")
REDIS_USERNAME = Var("BATON_REDIS_USERNAME", "the Redis ACL user a service logs in as")
REDIS_PASSWORD = Var("BATON_REDIS_PASSWORD", "Redis's password (or BATON_REDIS_PASSWORD_FILE)")
CLUSTER_SECRET = Var("BATON_CLUSTER_SECRET", "the HMAC key of worker records (or BATON_CLUSTER_SECRET_FILE)")

ALL = (
    CACHE_DIR,
    KERNEL_CACHE,
    KERNEL_ISA,
    BF16_GEMM,
    ONE_CALL_LAYERS,
    API_KEY,
    REDIS_USERNAME,
    REDIS_PASSWORD,
    CLUSTER_SECRET,
)


def api_keys(environ: Mapping[str, str] | None = None) -> list[str]:
    """``BATON_API_KEY`` split on commas, blanks dropped."""
    return [k.strip() for k in (API_KEY.get(environ) or "").split(",") if k.strip()]
