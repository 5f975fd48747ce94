"""Baton's bf16 GEMM (``cpu_ops.bf16_gemm``: vdpbf16ps or AMX tiles with AVX512-BF16, fp32 FMAs
with AVX2) against the exact product, and where the model runs it."""

from __future__ import annotations

import pytest
import torch


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_AVX512_BF16 = "avx512_bf16" in _cpu_flags()
# The kernel's CPUs: AVX512-BF16, or AVX2 with FMA (the weights widened to fp32 on the way in).
HAS_KERNEL = HAS_AVX512_BF16 or {"avx2", "fma"} <= _cpu_flags()


@pytest.mark.skipif(not HAS_KERNEL, reason="bf16_gemm's kernel needs AVX512-BF16 or AVX2")
# (M, N, K): one row; a row tile (6), a ragged one, a tile and five rows, K one pair; SmolLM2's qkv and down shapes at a decode
# batch; N not a multiple of 16 nor of a column tile; the LM head's width. From 16 rows with K a
# multiple of 32 the AMX tiles run where the build has them: one row tile, a ragged pair, an odd
# column block, a prefill chunk's down projection; (20, 48, 40) stays on vdpbf16ps (K). Outputs
# of 2 MiB and more are written with streaming stores where N is a multiple of 32 (ragged rows
# included), and not where it is not.
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 64, 64),
        (6, 70, 96),
        (11, 70, 96),
        (6, 16, 2),
        (13, 960, 576),
        (9, 576, 1536),
        (3, 33, 2),
        (2, 49152, 576),
        (16, 32, 32),
        (37, 70, 96),
        (50, 48, 64),
        (128, 576, 1536),
        (20, 48, 40),
        (1100, 1024, 64),
        (1030, 1040, 96),
    ],
)
def test_bf16_gemm_is_the_exact_product_rounded_once(m, n, k):
    _check_product(m, n, k, torch.full((m, n), float("nan"), dtype=torch.bfloat16))


@pytest.mark.skipif(not HAS_KERNEL, reason="bf16_gemm's kernel needs AVX512-BF16 or AVX2")
@pytest.mark.parametrize("m,n,k", [(1, 576, 1536), (64, 960, 576), (1030, 1040, 96), (3, 16, 32)])
def test_any_number_of_threads_gives_the_same_bits(m, n, k):
    """The column units go to the threads in shares that a thread finishing early takes from
    (``dynamic_for.h``); 3 threads on 2 cores leave one descheduled now and then, so the others
    take its chunks. Which thread ran a chunk must not show in the result, nor in the gate/up
    product with silu."""
    from baton.kernels import cpu_ops

    gen = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.3).bfloat16()
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    packed = cpu_ops.bf16_gemm_pack(w)
    before = torch.get_num_threads()
    outs, gated = [], []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
            cpu_ops.bf16_gemm(x, packed, out)
            outs.append(out)
            if n % 32 == 0:
                g = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16)
                cpu_ops.bf16_gemm_silu_mul(x, packed, g)
                gated.append(g)
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int16), other.view(torch.int16))
    for other in gated[1:]:
        assert torch.equal(gated[0].view(torch.int16), other.view(torch.int16))


@pytest.mark.skipif(not HAS_KERNEL, reason="bf16_gemm's kernel needs AVX512-BF16 or AVX2")
def test_a_large_output_not_on_a_64_byte_boundary_is_still_written_whole():
    m, n = 1100, 1024  # large enough for streaming stores, which need aligned lines
    storage = torch.full((m * n + 1,), float("nan"), dtype=torch.bfloat16)
    out = storage[1:].view(m, n)
    assert out.data_ptr() % 64 != 0
    _check_product(m, n, 64, out)


def _check_product(m: int, n: int, k: int, out: torch.Tensor) -> None:
    from baton.kernels import cpu_ops

    assert cpu_ops.bf16_gemm_available()
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    cpu_ops.bf16_gemm(x, cpu_ops.bf16_gemm_pack(w), out)

    exact = x.double() @ w.double().t()  # bf16 products are exact in fp64
    magnitude = x.double().abs() @ w.double().abs().t()
    # bf16's rounding of the result (half a unit in the 8th bit), plus fp32 sums over K terms.
    bound = exact.abs() * 2.0**-8 + magnitude * k * 2.0**-24
    err = (out.double() - exact).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"


def test_bf16_gemm_refuses_bad_inputs():
    from baton.kernels import cpu_ops

    packed = cpu_ops.bf16_gemm_pack(torch.ones(20, 8, dtype=torch.bfloat16))
    assert packed.shape == (2, 4, 32)
    assert packed[1, :, 8:].eq(0).all() and packed[1, :, :8].eq(1).all()  # channels 20..31 padded
    with pytest.raises(ValueError, match="K even"):
        cpu_ops.bf16_gemm_pack(torch.ones(20, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="packed must be"):
        cpu_ops.bf16_gemm(torch.randn(2, 12).bfloat16(), packed, torch.empty(2, 20, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be"):
        cpu_ops.bf16_gemm(torch.randn(2, 8), packed, torch.empty(2, 20, dtype=torch.bfloat16))


def test_the_model_runs_the_kernel_where_the_cpu_has_avx512_bf16_amx_avx2_or_not(monkeypatch):
    from baton.common.model.llama import Bf16GemmWeight, Linear, OneDNNWeight, own_bf16_gemm
    from baton.kernels import cpu_ops

    expected = HAS_KERNEL
    assert cpu_ops.has_avx512_bf16() == HAS_AVX512_BF16
    assert own_bf16_gemm() == expected
    monkeypatch.setenv("BATON_BF16_GEMM", "onednn")
    assert not own_bf16_gemm()
    monkeypatch.delenv("BATON_BF16_GEMM")

    torch.manual_seed(0)
    linear = Linear(576, 960).to(torch.bfloat16)
    x = torch.randn(3, 576).bfloat16()
    plain = torch.nn.functional.linear(x, linear.weight).float()
    linear.prepack()
    assert linear.weight is None
    assert isinstance(linear.packed, Bf16GemmWeight if expected else OneDNNWeight)
    out = linear(x)
    assert out.shape == (3, 960) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), plain, rtol=2**-7, atol=0.05)


def test_the_environment_chooses_the_kernel(monkeypatch):
    from baton.common.model.llama import Bf16GemmWeight, own_bf16_gemm, prepack_weight
    from baton.kernels import cpu_ops

    w = torch.randn(32, 64).bfloat16()
    monkeypatch.setenv("BATON_BF16_GEMM", "onednn")
    assert not own_bf16_gemm()
    # oneDNN's layout, or the plain weight where oneDNN has no bf16 product (AVX2 only)
    assert not isinstance(prepack_weight(w), Bf16GemmWeight)
    if HAS_AVX512_BF16:
        assert type(prepack_weight(w)).__name__ == "OneDNNWeight"
    monkeypatch.setenv("BATON_BF16_GEMM", "baton")
    assert own_bf16_gemm() == cpu_ops.bf16_gemm_available()
    monkeypatch.setenv("BATON_BF16_GEMM", "fastest")
    with pytest.raises(ValueError, match="BATON_BF16_GEMM"):
        own_bf16_gemm()


@pytest.mark.skipif(not HAS_KERNEL, reason="bf16_gemm's kernel needs AVX512-BF16 or AVX2")
# (M, I, K): one row (a decode step), a row tile and a ragged pair, SmolLM2's MLP at a decode batch
# and a prefill chunk's rows; K not a multiple of 32 and I not a multiple of 16 take the two kernels
# in turn.
@pytest.mark.parametrize(
    "m,inter,k",
    [(1, 1536, 576), (16, 64, 64), (37, 48, 96), (64, 1536, 576), (1030, 256, 576), (5, 48, 40), (9, 40, 64)],
)
def test_gate_up_with_silu_in_the_epilogue_is_the_bits_of_the_two_kernels(m, inter, k):
    from baton.kernels import cpu_ops, fused

    gen = torch.Generator().manual_seed(m + inter + k)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.3).bfloat16()
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    packed = cpu_ops.bf16_gemm_pack(w)
    gate_up = torch.empty(m, 2 * inter, dtype=torch.bfloat16)
    cpu_ops.bf16_gemm(x, packed, gate_up)
    want = fused.silu_mul(gate_up, torch.empty(m, inter, dtype=torch.bfloat16))
    got = torch.full((m, inter), float("nan"), dtype=torch.bfloat16)
    cpu_ops.bf16_gemm_silu_mul(x, packed, got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    scratch = torch.empty(m * 2 * inter + 7, dtype=torch.bfloat16)
    again = torch.full((m, inter), float("nan"), dtype=torch.bfloat16)
    cpu_ops.bf16_gemm_silu_mul(x, packed, again, scratch)
    assert torch.equal(again.view(torch.int16), want.view(torch.int16))


def test_gate_up_with_silu_refuses_a_product_of_another_width():
    from baton.kernels import cpu_ops

    packed = cpu_ops.bf16_gemm_pack(torch.ones(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gate; up"):
        cpu_ops.bf16_gemm_silu_mul(
            torch.ones(2, 32, dtype=torch.bfloat16), packed, torch.empty(2, 48, dtype=torch.bfloat16)
        )
