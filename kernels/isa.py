"""The x86 levels the CPU kernels are built for, and which one a CPU runs. Imports no torch.

A build for ``native`` (``-march=native``) is the fastest on the machine that compiled it and only
there: its name carries the CPU's flags. An image cannot know the CPU it will land on, so its
builder compiles the kernels once per declared level (``baton build-kernels --isa all``); a process
then imports the best level whose instructions its CPU has, and compiles nothing. The kernels pick
their paths by the compiler's macros (``__AVX512BF16__``, ``__AMX_BF16__``, ...), so each level's
flags decide which paths it carries.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

# /proc/cpuinfo names of each x86-64 micro-architecture level's instructions (the psABI's list).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class IsaLevel:
    """One portable build of the kernels."""

    name: str
    cflags: tuple[str, ...]
    """What ``-march=native`` is replaced with."""
    requires: frozenset[str]
    """The CPU flags (as /proc/cpuinfo spells them) every instruction the flags allow needs."""


LEVELS: tuple[IsaLevel, ...] = (
    # Sapphire Rapids and later Xeons: Baton's bf16 GEMM, prefill attention and cascade on AMX tiles.
    IsaLevel(
        "amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
        _V4 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
    ),
    # AMD Zen 4 and 5, Cooper Lake: Baton's vdpbf16ps GEMM and attention, the VNNI int8 kernels.
    IsaLevel(
        "avx512-bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        _V4 | {"avx512_bf16", "avx512_vnni"},
    ),
    # AMD Zen 2 and 3, Haswell to Alder Lake: Baton's bf16 GEMM on fp32 FMAs, int8 with 7-bit codes.
    IsaLevel("avx2", ("-march=x86-64-v3",), _V3),
)
"""Best first: a CPU runs the first level whose ``requires`` it has."""

NATIVE = "native"
"""The build for the CPU that compiles it (``make install``'s, and a worker's when nothing fits)."""


def by_name(name: str) -> IsaLevel:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"unknown kernel ISA level {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    return [level.name for level in LEVELS]


def parse(spec: str) -> list[str]:
    """``native``, ``all`` or a comma-separated list of level names -> the builds to make."""
    wanted = [part.strip() for part in spec.split(",") if part.strip()]
    if wanted == ["all"]:
        return names()
    for name in wanted:
        if name != NATIVE:
            by_name(name)
    if not wanted:
        raise ValueError("no kernel ISA level given")
    return wanted


def runnable(cpu: frozenset[str] | set[str]) -> list[IsaLevel]:
    """The levels a CPU with these flags can run, best first."""
    return [level for level in LEVELS if level.requires <= cpu]


_FLAG_LINES = ("flags", "Features")  # x86's and Arm's names for the line


def cpu_flags_line() -> str:
    """This CPU's feature line from /proc/cpuinfo (x86 ``flags``, Arm ``Features``; the processor's
    name elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(_FLAG_LINES):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as a set (empty where /proc/cpuinfo has none)."""
    line = cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if line.startswith(_FLAG_LINES) else frozenset()
