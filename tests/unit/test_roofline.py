"""The floor arithmetic of ``baton bench roofline`` on fixed numbers, and how it sizes a slow
kernel's GEMM to its time budget (on a stand-in with a nominal clock): no timing asserted, no torch."""

from __future__ import annotations

import pytest

from baton.bench.roofline import SMOLLM2, Ceilings, ModelShape, floors, fractions, gemm_gflops


def test_smollm2_parameters_are_the_models():
    assert SMOLLM2.parameters == 134_515_008  # SmolLM2-135M's count (tied embeddings)
    assert SMOLLM2.layer_weights == 576 * 960 + 576 * 576 + 3 * 576 * 1536
    # a decode step reads the 30 layers and the LM head once: 134.5 M less the norms
    assert SMOLLM2.decode_bytes("bf16") == 2 * (30 * SMOLLM2.layer_weights + 49152 * 576)


def test_batch1_floor_is_weight_bytes_over_bandwidth():
    shape = ModelShape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # q|k|v 4x8, o 4x4, gate|up + down 3x4x8: 32 + 16 + 96 = 144; head 40 -> 184 weights
    assert shape.decode_bytes("fp32") == 184 * 4
    f = floors(shape, Ceilings(read_gb_s=1e-6, gemm_gflops={}))  # 1000 B/s
    assert f["batch1_ms"]["fp32"] == pytest.approx(736.0 * 1e3 / 1000)
    assert f["batch1_ms"]["bf16"] == pytest.approx(368.0)
    # int8: 1 B a weight + a 4-byte scale per output channel (8 + 4 + 16 + 4 per layer, 10 of the head)
    assert shape.decode_bytes("int8") == 184 + 4 * (32 + 10)
    assert f["w1_tok_s"] == {}


def test_w1_ceiling_is_tokens_over_flops_at_peak():
    shape = ModelShape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # a request of 3 prompt + 2 output tokens computes 4 tokens, samples 2, attends 1+2+3+4 positions
    flops = 2 * 144 * 4 + 2 * 40 * 2 + 4 * 1 * 2 * 2 * 10
    assert shape.request_flops(3, 2) == flops
    f = floors(shape, Ceilings(read_gb_s=1.0, gemm_gflops={"bf16": 1e-9 * flops, "int8": 0.0}), 3, 2, 4)
    assert f["w1_tok_s"] == {"bf16": pytest.approx(5.0)}  # 4 requests: 20 tokens in 4 s; int8 at 0 skipped


def test_smollm2_w1_flops_per_token_match_benchmarks_md():
    per_token = SMOLLM2.request_flops(256, 128) / 384
    assert 0.23e9 < per_token < 0.27e9  # ~0.27 GFLOP/token counting the LM head on every token


def test_fractions_of_the_floors():
    f = {"batch1_ms": {"bf16": 8.0}, "w1_tok_s": {"bf16": 1600.0}}
    got = fractions(f, "bf16", batch1_ms=12.0, w1_tok_s=1200.0)
    assert got["batch1"]["fraction"] == pytest.approx(8 / 12)
    assert got["batch1"]["x_floor"] == pytest.approx(1.5)
    assert got["w1"]["fraction"] == pytest.approx(0.75)
    assert fractions(f, "fp32", 12.0, 1200.0) == {}
    assert fractions(f, "bf16", None, None) == {}


def _nominal_product(seconds_per_flop: float):
    """A stand-in kernel whose n³ product 'takes' n³ x ``seconds_per_flop``: the call returns its
    nominal time, which ``_nominal_clock`` reports (nothing is timed: a busy machine cannot move it)."""
    return lambda n: lambda: n**3 * seconds_per_flop


def _nominal_clock(call, repeats: int) -> float:
    return call()


def test_a_kernel_too_slow_for_the_size_is_measured_on_a_smaller_cube_within_the_budget():
    # 1024³ x 11 calls would take 1.2 s, over the 1 s budget; 512³'s 0.15 s fit.
    gflops, size = gemm_gflops(_nominal_product(1e-10), 2048, 10, budget_s=1.0, time_s=_nominal_clock)
    assert size == 512
    assert gflops == pytest.approx(2.0 * 512**3 / (512**3 * 1e-10) / 1e9)


def test_a_fast_kernel_is_measured_at_the_size_asked():
    got = gemm_gflops(_nominal_product(1e-13), 2048, 10, budget_s=1.0, time_s=_nominal_clock)
    assert got == (pytest.approx(2.0 / 1e-13 / 1e9), 2048)
