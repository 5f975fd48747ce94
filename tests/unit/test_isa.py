"""Which portable kernel build a CPU runs (kernels/isa.py; pure, no torch)."""

from __future__ import annotations

import pytest

from baton.kernels import isa

# /proc/cpuinfo flags of the kinds met so far (trimmed to what the levels look at).
ZEN3 = frozenset(
    "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()
)
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
SKYLAKE_X = ZEN4 - {"avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (SAPPHIRE_RAPIDS, ["amx", "avx512-bf16", "avx2"]),
        (ZEN4, ["avx512-bf16", "avx2"]),
        (SKYLAKE_X, ["avx2"]),
        (ZEN3, ["avx2"]),
        (ZEN3 - {"avx2"}, []),
        (frozenset(), []),
    ],
)
def test_a_cpu_runs_the_levels_whose_instructions_it_has_best_first(flags, want):
    assert [level.name for level in isa.runnable(flags)] == want


def test_every_level_asks_the_compiler_only_for_what_it_requires():
    spelled = {
        "-mavx512bf16": "avx512_bf16",
        "-mavx512vnni": "avx512_vnni",
        "-mamx-tile": "amx_tile",
        "-mamx-bf16": "amx_bf16",
        "-mamx-int8": "amx_int8",
    }
    march = {"-march=x86-64-v3": "avx2", "-march=x86-64-v4": "avx512f"}
    for level in isa.LEVELS:
        for flag in level.cflags:
            assert (spelled | march)[flag] in level.requires, (level.name, flag)


def test_parse_names_builds():
    assert isa.parse("all") == ["amx", "avx512-bf16", "avx2"]
    assert isa.parse("native") == ["native"]
    assert isa.parse("avx2, native") == ["avx2", "native"]
    with pytest.raises(ValueError, match="unknown kernel ISA level 'sse2'"):
        isa.parse("sse2")
    with pytest.raises(ValueError):
        isa.parse(" , ")
