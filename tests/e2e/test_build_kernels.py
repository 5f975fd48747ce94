"""Nothing compiles at serving time: ``baton build-kernels`` compiles the CPU kernels into an empty
cache and a second run only imports them; a worker whose build is missing (and whose last build
was killed, leaving torch's lock file behind) compiles it in its warm-up, before it reports ready;
a portable level (what an image's builder makes) is imported as it is by a CPU that runs it; the
other levels compile and link for their targets (``--check``) on any CPU, and a failed compile is
one line.

One real compile (about a minute on 2 busy cores) into a fresh cache folder, shared by the module:
the portable ``avx2`` level, which every CPU kind this project lands on runs (``native``, the same
sources with ``-march=native``, is what ``make install`` compiles before the tests).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.e2e.tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow

BUILD_TIMEOUT_S = 600.0
"""A cold compile takes ~50 s on an idle 2-core machine; a shared one is several times slower."""

REPORT = re.compile(r"CPU kernels (built|already built): (\S+) \(([\d.]+) s\)")


LEVEL = "avx2"


def _build_kernels(cache: Path) -> tuple[str, Path, float]:
    """Run ``baton build-kernels --isa avx2 --cache-dir cache``; return its verb, library path and
    seconds."""
    done = subprocess.run(
        [sys.executable, "-m", "baton.cli", "build-kernels", "--isa", LEVEL, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    found = REPORT.search(done.stdout)
    assert found, f"no build report in {done.stdout!r}"
    return found[1], Path(found[2]), float(found[3])


@pytest.fixture(scope="module")
def cold_build(tmp_path_factory) -> tuple[Path, tuple[str, Path, float]]:
    cache = tmp_path_factory.mktemp("kernel-cache")
    assert not any(cache.iterdir())
    return cache, _build_kernels(cache)


def _runs_the_level() -> None:
    from baton.kernels import isa

    if LEVEL not in {level.name for level in isa.runnable(isa.cpu_flags())}:
        pytest.skip(f"this CPU cannot run the {LEVEL} level")


def test_build_kernels_compiles_into_an_empty_cache(cold_build):
    cache, (verb, library, _) = cold_build
    assert verb == "built"
    assert library.is_file()
    assert library.parent.parent == cache
    assert library.name.startswith(f"baton_cpu_kernels_{LEVEL}_") and library.suffix == ".so"


def test_build_kernels_again_only_imports(cold_build):
    cache, (_, library, _) = cold_build
    mtime = library.stat().st_mtime_ns
    verb, again, seconds = _build_kernels(cache)
    assert (verb, again) == ("already built", library)
    assert seconds < 5.0, f"a second build-kernels took {seconds} s: it recompiled"
    assert library.stat().st_mtime_ns == mtime


WORKER = textwrap.dedent(
    """
    import sys
    from baton.common.engine.config import EngineConfig
    from baton.kernels import cpu_ops
    from baton.services.worker_base import build_engine

    assert not cpu_ops.is_built(), "the build was not missing"
    assert cpu_ops.loaded() is None
    engine = build_engine(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_gib=0.05,
                                       max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4))
    # What build_engine returns is what the worker serves with: the kernels are in by then.
    print(f"loaded={cpu_ops.loaded() is not None} built={cpu_ops.is_built()}")
    """
)


def test_worker_builds_a_missing_kernel_before_ready(cold_build, tmp_path):
    _runs_the_level()
    cache, (_, library, _) = cold_build
    library.unlink()  # the build is missing (its objects stay: the relink is the cheap case) ...
    (library.parent / "lock").write_text("")  # ... and a killed build left torch's lock behind
    model = write_tiny_llama(tmp_path / "tiny", hidden=64, max_len=256)
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(model)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, "BATON_KERNEL_CACHE": str(cache), "BATON_KERNEL_ISA": LEVEL},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "loaded=True built=True"
    assert library.is_file()


def test_build_kernels_reports_a_failed_build_in_one_line(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "baton.cli", "build-kernels", "--cache-dir", str(not_a_folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "error: could not build the CPU kernels" in done.stderr
    assert "Traceback" not in done.stderr


# -- portable levels: what an image's builder makes, and what a CPU it lands on imports ------------
LEVEL_CHECK = textwrap.dedent(
    """
    import os, sys, torch
    from baton.kernels import cpu_ops, reference
    module = cpu_ops.load()
    print(os.path.basename(module.__file__))
    q = torch.randn(3, 9, 64)
    k = torch.randn(8, 3, 16, 64)
    v = torch.randn(8, 3, 16, 64)
    tables = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 48], dtype=torch.int32)
    got = cpu_ops.paged_decode_attention(q, k, v, tables, lens, 0.125)
    want = reference.paged_decode_attention_ref(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The level's prefill attention (on AVX2 the 6-row x 16-key tile, prefill_avx2.h): sequences
    # whose new rows start past cached keys and end inside a chunk, D 64 and 128, bf16 and fp32.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for H, KV, D in ((9, 3, 64), (4, 2, 128)):
            new, ctx, bs = [40, 37, 1], [140, 37, 20], 16
            k = torch.randn(40, KV, bs, D).to(dtype)
            v = torch.randn(40, KV, bs, D).to(dtype)
            q = torch.randn(sum(new), H, D).to(dtype)
            tables = torch.randperm(40, dtype=torch.int32)[:27].reshape(3, 9)
            lens = torch.tensor(ctx, dtype=torch.int32)
            qsl = torch.tensor([0, 40, 77, 78], dtype=torch.int32)
            got = cpu_ops.paged_prefill_attention(q, k, v, tables, lens, qsl, D**-0.5)
            for s in range(3):
                rows = slice(int(qsl[s]), int(qsl[s + 1]))
                want = reference.paged_prefill_attention_ref(q[rows], k, v, tables[s], ctx[s], D**-0.5)
                torch.testing.assert_close(got[rows].float(), want.float(), rtol=tol, atol=tol)
    # The level's bf16 GEMM (on AVX2 the few-rows loop and the inline-asm 6 x 16 tile with its
    # ragged tails): each output the exact product, rounded to bf16 once, plus fp32 sums' error.
    if cpu_ops.bf16_gemm_available():
        for m, n, k in ((1, 64, 64), (3, 33, 2), (13, 70, 96), (64, 960, 576)):
            w = torch.randn(n, k).bfloat16()
            x = (torch.randn(m, k) * 3).bfloat16()
            out = torch.empty(m, n, dtype=torch.bfloat16)
            cpu_ops.bf16_gemm(x, cpu_ops.bf16_gemm_pack(w), out)
            exact = x.double() @ w.double().t()
            bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2.0**-24
            assert ((out.double() - exact).abs() <= bound).all(), (m, n, k)
    print(f"bf16_gemm={cpu_ops.bf16_gemm_available()} avx512_bf16={cpu_ops.has_avx512_bf16()}")
    """
)


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_a_portable_level_is_imported_by_a_cpu_that_runs_it_and_nothing_is_written(cold_build, tmp_path):
    _runs_the_level()
    _, (_, built, _) = cold_build
    # As the image's builder leaves it: the library alone, in a cache of its own.
    library = tmp_path / "image-cache" / built.parent.name / built.name
    library.parent.mkdir(parents=True)
    shutil.copy2(built, library)
    cache = tmp_path / "image-cache"
    before = _snapshot(cache)
    # No native build there and none for a better level: the avx2 library is imported as it is.
    run = subprocess.run(
        [sys.executable, "-c", LEVEL_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "BATON_KERNEL_CACHE": str(cache), "BATON_KERNEL_ISA": ""},
    )
    assert run.returncode == 0, run.stderr
    name, gemm, dot = run.stdout.split()
    assert name == library.name
    # The bf16 GEMM on AVX2's fp32 FMAs, and no vdpbf16ps.
    assert (gemm, dot) == ("bf16_gemm=True", "avx512_bf16=False"), (
        "an avx2 build: the bf16 GEMM on fp32 FMAs only"
    )
    assert _snapshot(cache) == before, "importing a build wrote into the cache"


# -- the other levels: every one compiles, whatever CPU runs the suite -----------------------------
OTHER_LEVELS = ["amx", "avx512-bf16"]
"""The levels the cold build above does not make. CI's image builds only its runner's level
(tests/containers/host.sh), so this is where every level's build is proven on every runner."""


def _check(levels: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "baton.cli", "build-kernels", "--isa", ",".join(levels), "--check"],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={**os.environ, **env},
    )


def test_every_level_compiles_and_links_for_its_target():
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("baton-kernels-check-*"))
    done = _check(OTHER_LEVELS)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"CPU kernels compile for (\S+) \(", done.stdout) == OTHER_LEVELS, done.stdout
    after = set(temp.glob("baton-kernels-check-*"))
    assert after == before, f"a check left {after - before} behind"


def test_a_compiler_that_fails_is_one_line_and_exit_1(tmp_path):
    """torch's builds take the compiler from ``CXX`` and ask it ``--version`` first: ``false``
    fails there, as a missing or broken compiler would (once a traceback)."""
    done = _check(["avx2"], CXX="false")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "error: the CPU kernels do not build for avx2" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "baton.cli", "build-kernels", "--isa", "avx2", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CXX": "false"},
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "error: could not build the CPU kernels" in done.stderr
    assert "Traceback" not in done.stderr
