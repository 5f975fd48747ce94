"""``gemm_probe``: the GEMM timings that ``--dtype auto`` and ``baton up``'s layout rest on."""

from __future__ import annotations

import json

from baton.common.model import gemm_probe
from baton.common.model.config import LlamaConfig

TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_probe_picks_the_dtype_whose_request_costs_least():
    p = gemm_probe.probe(TINY, threads=1, decode_threads=[1], candidates=gemm_probe.CANDIDATES)
    assert set(p.request_ms) == {"bfloat16", "float32"}
    assert p.dtype == min(p.request_ms, key=p.request_ms.get)
    for d in p.request_ms:  # a request: one prefill and DECODE_STEPS decode steps
        want = p.prefill_ms[d] + gemm_probe.DECODE_STEPS * p.decode_step_ms[d]
        assert abs(p.request_ms[d] - want) < 1e-6 and p.prefill_ms[d] > 0 and p.decode_step_ms[d] > 0
    assert p.decode_step_ms_by_threads == {"1": p.decode_step_ms[p.dtype]}  # the same case, timed once


def test_the_dtype_is_the_cpus_where_its_flags_say(monkeypatch):
    """An AVX2-only AMD EPYC (oneDNN's bf16 matmul ~1 GFLOP/s, fp32 ~140) gets bf16 for Baton's GEMM
    to widen into fp32 FMAs, as an AVX512-BF16, AMX or Arm BF16 CPU gets it for its instruction; a
    CPU with neither fp32; only a CPU whose flags cannot be read times both."""
    avx2 = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
    for flags, want in [
        (avx2, ("bfloat16",)),
        (avx2 | {"avx512f", "avx512_vnni"}, ("bfloat16",)),
        ({"fpu", "sse2", "avx"}, ("float32",)),
        (avx2 - {"fma"}, ("float32",)),
        (avx2 | {"avx512f", "avx512_bf16"}, ("bfloat16",)),
        (avx2 | {"amx_bf16", "amx_tile"}, ("bfloat16",)),
        ({"fp", "asimd", "bf16"}, ("bfloat16",)),
        (set(), gemm_probe.CANDIDATES),
    ]:
        monkeypatch.setattr(gemm_probe, "cpu_flags", lambda flags=flags: flags)
        assert gemm_probe.auto_dtypes() == want, flags
    monkeypatch.setattr(gemm_probe, "cpu_flags", lambda: {"fpu", "sse2", "avx"})
    p = gemm_probe.probe(TINY, threads=1)
    assert p.dtype == "float32" and set(p.request_ms) == {"float32"}


def test_timings_beside_a_loaded_machine_do_not_change_the_dtype(monkeypatch):
    """A prefill worker and its decode workers decide ``--dtype auto`` each on its own and must
    agree (their KV is exchanged): on a CPU that multiplies bf16, bf16 even where fp32's timings
    come out cheaper (as they once did for one of three workers starting on 2 cores, in CI)."""
    monkeypatch.setattr(gemm_probe, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})

    def loaded(cases, rounds=gemm_probe.ROUNDS):  # fp32 10x cheaper than bf16, as noise could make it
        return {key: (1.0 if key[1] == "float32" else 10.0) for key in cases}

    monkeypatch.setattr(gemm_probe, "_interleaved_ms", loaded)
    p = gemm_probe.probe(TINY, threads=1, decode_threads=[1])
    assert p.dtype == "bfloat16" and set(p.request_ms) == {"bfloat16"}
    # Both timed (flags unreadable, or asked for): the cheaper wins, so such timings would flip it.
    both = gemm_probe.probe(TINY, threads=1, candidates=gemm_probe.CANDIDATES)
    assert both.dtype == "float32"


def test_projection_shapes_are_the_fused_layers():
    assert gemm_probe.projection_shapes(TINY) == [(64 + 2 * 32, 64), (64, 64), (256, 64), (64, 128)]


def test_a_probe_is_remembered_per_model_file_and_thread_counts(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY.to_hf()))
    (model / "model.safetensors").write_bytes(b"")  # only the config is read
    cache = str(tmp_path / "cache")
    assert gemm_probe.cached(str(model), 1, [1], cache) is None
    first = gemm_probe.cached_probe(str(model), 1, [1], cache)
    assert gemm_probe.cached(str(model), 1, [1], cache) == first
    assert gemm_probe.cached_probe(str(model), 1, [1], cache) == first  # read, not measured again
    assert gemm_probe.cached(str(model), 2, [1], cache) is None  # other threads: another figure
    (model / "config.json").write_text(json.dumps({**TINY.to_hf(), "num_hidden_layers": 3}))
    assert gemm_probe.cached(str(model), 1, [1], cache) is None  # the model file changed


def test_probes_live_under_baton_cache_dir(tmp_path, monkeypatch):
    """``BATON_CACHE_DIR`` moves the probes with the tokenizer and weights (an image's ENV, a pod's
    volume); unset, they are under ``~/.cache/baton``."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY.to_hf()))
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "baton-cache"))
    assert gemm_probe.default_cache_dir() == str(tmp_path / "baton-cache" / "gemm-probe")
    first = gemm_probe.cached_probe(str(model), 1, [1])
    written = list((tmp_path / "baton-cache" / "gemm-probe").glob("*.json"))
    assert len(written) == 1 and gemm_probe.cached(str(model), 1, [1]) == first
    monkeypatch.delenv("BATON_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gemm_probe.default_cache_dir() == str(tmp_path / "home" / ".cache" / "baton" / "gemm-probe")


def test_a_read_only_cache_dir_costs_a_warning_not_the_start(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY.to_hf()))
    (model / "model.safetensors").write_bytes(b"")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the cache directory would be: makedirs fails
    p = gemm_probe.cached_probe(str(model), 1, [1], str(blocker / "gemm-probe"))
    assert p.dtype in p.request_ms
    assert "GEMM probe is not remembered" in capsys.readouterr().err
    assert gemm_probe.cached(str(model), 1, [1], str(blocker / "gemm-probe")) is None
