"""Quantized-weight kernels against their torch references: the CPU passes around the int8 GEMM
(bit-identical), the int8 and fp8 linears against the fp32 product (within their formats'
rounding), and the Triton fp8 GEMM under TRITON_INTERPRET=1 (in a fresh interpreter, as
test_triton_decode.py explains)."""

from __future__ import annotations

import os

if __name__ == "__main__":  # the subprocess below; never flip the pytest process into interpret mode
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys

import pytest
import torch

# (M, N, K): one row, a ragged tile, SmolLM2's o_proj at a decode batch, K not a tile multiple.
TRITON_CASES = [(1, 64, 64), (5, 70, 96), (20, 576, 64), (3, 33, 100)]


def _weight(n: int, k: int, seed: int, edge_cases: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if edge_cases:
        w[0] = 0.0  # an all-zero channel keeps a finite scale
        w[1, 3] = 4.0  # an outlier channel
    return w


def _cpu_has_vnni_flag() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_vnni" in f.read()
    except OSError:
        return False


def run_triton_cases() -> None:
    from baton.common.model.quant import quantize_fp8
    from baton.kernels.triton_quant import fp8_linear, fp8_linear_ref

    for dtype in (torch.float32, torch.bfloat16):
        for i, (m, n, k) in enumerate(TRITON_CASES):
            q, scale = quantize_fp8(_weight(n, k, i))
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
            out = fp8_linear(x, q, scale)
            ref = fp8_linear_ref(x, q, scale)
            assert out.dtype == dtype and out.shape == (m, n)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            err = (out.float() - ref.float()).abs().max().item()
            assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), f"{dtype} {(m, n, k)}: {err}"
            print(f"ok {dtype} {(m, n, k)} max_err={err:.2e}")
    # Every one of the 254 finite e4m3 codes (subnormals and both signs) decodes exactly.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())].reshape(-1, 1)  # [254, 1]
    eye = torch.ones(1, 1)
    decoded = fp8_linear(eye, codes.view(torch.float8_e4m3fn), torch.ones(len(codes)))
    assert torch.equal(decoded[0], codes.view(torch.float8_e4m3fn).float()[:, 0])
    print("ok every e4m3 code")


def test_triton_fp8_linear_matches_reference_in_interpreter():
    pytest.importorskip("triton")  # a third-party GPU compiler, not the project's own module
    proc = subprocess.run(
        [sys.executable, __file__],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("ok ") == 2 * len(TRITON_CASES) + 1, proc.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_int8_passes_are_identical_to_torch(dtype):
    from baton.common.model.quant import quantize_rows_int8
    from baton.kernels import cpu_ops

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=gen) * 3).to(dtype)  # K not a multiple of 16: the tail loop
    x[5] = 0.0  # an all-zero row
    codes, scales = torch.empty(37, 200, dtype=torch.int8), torch.empty(37)
    cpu_ops.int8_quantize_rows(x, codes, scales)
    ref_codes, ref_scales = quantize_rows_int8(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales[:, 0])
    assert codes.abs().max() == 127 and not codes[5].any()
    # uint8 codes (oneDNN's VNNI input, zero point 128) are the same codes + 128.
    shifted, shifted_scales = torch.empty(37, 200, dtype=torch.uint8), torch.empty(37)
    cpu_ops.int8_quantize_rows(x, shifted, shifted_scales)
    assert torch.equal(shifted.int() - 128, codes.int()) and torch.equal(shifted_scales, scales)
    # 7-bit codes (a CPU without VNNI): in [-63, 63], uint8 + 64, as the reference.
    cpu_ops.int8_quantize_rows(x, codes, scales, 63)
    ref_codes, ref_scales = quantize_rows_int8(x, 63)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales[:, 0])
    assert codes.abs().max() == 63
    cpu_ops.int8_quantize_rows(x, shifted, shifted_scales, 63)
    assert torch.equal(shifted.int() - 64, codes.int()) and torch.equal(shifted_scales, scales)
    with pytest.raises(ValueError, match="qmax"):
        cpu_ops.int8_quantize_rows(x, codes, scales, 128)

    acc = torch.randint(-(2**20), 2**20, (37, 70), dtype=torch.int32, generator=gen)
    col = torch.rand(70, generator=gen)
    out = torch.empty(37, 70, dtype=dtype)
    cpu_ops.int8_scale_output(acc, scales, col, out)
    assert torch.equal(out, (acc.float() * scales[:, None] * col).to(dtype))

    # oneDNN's fp32 product (channel scales applied) times the token's scale, in one pass.
    prod = torch.randn(37, 70, generator=gen) * 1000
    rows = torch.empty(37, 70, dtype=dtype)
    cpu_ops.int8_scale_rows(prod, scales, rows)
    assert torch.equal(rows, (prod * scales[:, None]).to(dtype))


@pytest.mark.skipif(not _cpu_has_vnni_flag(), reason="int8_gemm's kernel needs AVX512-VNNI")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# (M, N, K): one row; a row tile and a ragged one; SmolLM2's qkv (960) and down (K 1536) at a
# decode batch; N not a multiple of 16 (a masked last block) and of the 64-column tile.
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 70, 96), (64, 960, 576), (9, 576, 1536), (3, 33, 100)])
def test_int8_gemm_is_the_int32_product_scaled(dtype, m, n, k):
    """The fused kernel's output has the bits of the unfused reference: the rows quantized by
    int8_quantize_rows, torch's int32 product, int8_scale_output."""
    from baton.common.model.quant import quantize_int8
    from baton.kernels import cpu_ops

    assert cpu_ops.int8_gemm_available()
    qweight, scale = quantize_int8(_weight(n, k, m))
    qweight[2] = 127  # a channel at the codes' limit: the zero point's share is largest there
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    x[0, 0] = 50.0  # an outlier sets row 0's scale
    packed, sums = cpu_ops.int8_gemm_pack(qweight)
    out = torch.empty(m, n, dtype=dtype)
    cpu_ops.int8_gemm(x, packed, sums, scale, out)

    codes, xs = torch.empty(m, k, dtype=torch.int8), torch.empty(m)
    cpu_ops.int8_quantize_rows(x, codes, xs)
    # torch._int_mm wants M > 16; the int32 product of codes this small is exact in int64 too.
    acc = (codes.long() @ qweight.long().t()).int()
    ref = torch.empty(m, n, dtype=dtype)
    cpu_ops.int8_scale_output(acc, xs, scale, ref)
    assert torch.equal(out, ref)


def test_int8_gemm_refuses_bad_inputs():
    from baton.kernels import cpu_ops

    packed, sums = cpu_ops.int8_gemm_pack(torch.ones(20, 8, dtype=torch.int8))
    assert packed.shape == (2, 2, 64) and sums.tolist() == [8] * 20 + [0] * 12
    with pytest.raises(ValueError, match="multiple of 4"):
        cpu_ops.int8_gemm_pack(torch.ones(20, 6, dtype=torch.int8))
    with pytest.raises(ValueError, match="packed must be"):
        cpu_ops.int8_gemm(torch.randn(2, 12), packed, sums, torch.ones(20), torch.empty(2, 20))
    with pytest.raises(ValueError, match="x's dtype"):
        cpu_ops.int8_gemm(torch.randn(2, 8), packed, sums, torch.ones(20), torch.empty(2, 20).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_fp8_widen_is_exact(dtype):
    from baton.kernels import cpu_ops

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    out = torch.empty(16, 16, dtype=dtype)
    cpu_ops.fp8_widen(codes, out)
    ref = codes.to(dtype)
    finite = ~torch.isnan(ref)
    assert torch.equal(out[finite], ref[finite])


def test_cpu_kernels_refuse_bad_inputs():
    from baton.kernels import cpu_ops

    with pytest.raises(ValueError, match="int8 or uint8"):
        cpu_ops.int8_quantize_rows(torch.randn(2, 8), torch.empty(2, 8), torch.empty(2))
    with pytest.raises(ValueError, match="one per row"):
        cpu_ops.int8_quantize_rows(torch.randn(2, 8), torch.empty(2, 8, dtype=torch.int8), torch.empty(3))
    with pytest.raises(ValueError, match="float8"):
        cpu_ops.fp8_widen(torch.zeros(4, dtype=torch.uint8), torch.empty(4))


# Relative error bounds against the fp32 product of the unquantized weight, about 1.5x what was
# measured on these weights: int8 weights ~0.7% (W8A8 ~1.0%; ~1.6% with the 7-bit activation codes
# of a CPU without VNNI), e4m3 weights ~2.7% (3 mantissa bits).
WEIGHT_BOUNDS = {"int8": 0.015, "int8-7bit": 0.025, "fp8": 0.04}


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 64])  # both sides of the weight-only / W8A8 switch
def test_quantized_linear_against_fp32(method, dtype, rows):
    from baton.common.model import quant

    w = _weight(96, 160, 0, edge_cases=False).to(dtype)
    if method == "int8":
        lin = quant.Int8Linear(*quant.quantize_int8(w), dtype, dtype)
    else:
        lin = quant.Fp8Linear(*quant.quantize_fp8(w), dtype, dtype)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    ref = x.float() @ w.float().t()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    w8a8 = method == "int8" and rows >= lin.weight_only_below
    seven_bit = w8a8 and lin.act_qmax == quant.ACT_QMAX_NO_VNNI
    bound = WEIGHT_BOUNDS["int8-7bit" if seven_bit else method]
    assert err < bound, f"{method} {dtype} rows={rows}: relative error {err:.4f}"
    # Against the exact product of the dequantized weight only the activations' rounding is left:
    # int8 codes from weight_only_below rows up (~0.7%, twice that with 7 bits), else bf16
    # rounding of the output or none.
    deq = lin.weight_fp32()
    exact = x.float() @ deq.t()
    act_err = ((y.float() - exact).norm() / exact.norm()).item()
    act_bound = (0.024 if seven_bit else 0.012) if w8a8 else 0.004
    assert act_err < act_bound, f"{method} {dtype} rows={rows}: {act_err:.4f}"
    # Each code is the weight rounded to its format: half a step of the channel's scale for int8,
    # half a unit in the last of e4m3's 3 mantissa bits (2^-4 relative, or 2^-10 scales if subnormal).
    diff, scale = (deq - w.float()).abs(), lin.scale[:, None]
    if method == "int8":
        assert (diff <= 0.5 * scale * (1 + 1e-4)).all()
    else:
        assert (diff <= torch.maximum(w.float().abs() * 2**-4, scale * 2**-10) * (1 + 1e-4)).all()


@pytest.mark.parametrize("rows", [1, 4, 64, 300])  # weight-only or not, fused or oneDNN's
def test_w8a8_is_the_exact_integer_product_of_its_codes_on_this_cpu(rows):
    """Whatever kernel this CPU's Int8Linear picks, a W8A8 row is the int32 product of the codes
    ``quantize_rows_int8`` gives at its ``act_qmax``, scaled: no saturation on the way (oneDNN's
    uint8 x int8 GEMM on an x86 CPU without VNNI saturates 8-bit codes' pair sums in int16)."""
    from baton.common.model import quant

    qweight, scale = quant.quantize_int8(_weight(200, 320, rows, edge_cases=False))
    qweight[3] = 127  # a channel at the codes' limit: the largest pair sums
    lin = quant.Int8Linear(qweight, scale, torch.float32, torch.float32)
    if rows < lin.weight_only_below:
        pytest.skip("this CPU takes the weight-only kernel at this row count")
    x = torch.randn(
        rows, 320, generator=torch.Generator().manual_seed(rows)
    ).abs()  # same signs: no cancelling
    codes, xs = quant.quantize_rows_int8(x, lin.act_qmax)
    want = (codes.long() @ qweight.long().t()).double() * xs.double() * scale.double()
    got = lin(x).double()
    err = ((got - want).abs() / want.abs().clamp_min(1e-6)).max().item()
    assert err < 1e-5, f"act_qmax {lin.act_qmax}, rows {rows}: worst relative error {err:.2e}"


def test_int8_linear_runs_the_fused_kernel_from_the_first_row_below_fused_below(monkeypatch):
    """Where Baton's VNNI kernel is compiled in, decode-sized products (1 to FUSED_BELOW - 1 rows)
    go to it, batch 1 included (it beats the weight-only kernel there); larger ones to oneDNN.
    Without it: weight-only below WEIGHT_ONLY_BELOW rows (8-bit codes) or W8A8 at every row count."""
    from baton.common.model import quant
    from baton.kernels import cpu_ops

    calls: dict[str, list[int]] = {"fused": [], "weight_only": [], "w8a8": []}
    for name, fn in (
        ("fused", quant.fused_int8_mm),
        ("weight_only", quant.weight_only_int8_mm),
        ("w8a8", quant.w8a8_int8_mm),
    ):
        monkeypatch.setattr(
            quant,
            f"{name}_int8_mm",
            lambda x, *a, _n=name, _f=fn, **kw: calls[_n].append(x.shape[0]) or _f(x, *a, **kw),
        )
    lin = quant.Int8Linear(
        *quant.quantize_int8(_weight(64, 128, 0, edge_cases=False)), torch.float32, torch.float32
    )
    rows = [1, 3, 4, quant.FUSED_BELOW - 1, quant.FUSED_BELOW, 300]
    for m in rows:
        lin(torch.randn(m, 128))
    fused = cpu_ops.int8_gemm_available() and quant.exact_u8s8_products()
    if fused:
        want = {"fused": rows[:4], "weight_only": [], "w8a8": rows[4:]}
    elif quant.exact_u8s8_products():
        want = {"fused": [], "weight_only": [1, 3], "w8a8": rows[2:]}
    else:
        want = {"fused": [], "weight_only": [], "w8a8": rows}
    assert calls == want


W8A8_PROBE = """
import torch
from baton.common.model import quant
w = quant.quantize_int8(torch.randn(96, 160) * 0.05)
lin = quant.Int8Linear(*w, torch.bfloat16, torch.bfloat16, fused_below=0)  # oneDNN at every row count
assert lin.packed is not None, "no oneDNN int8 prepack in this torch"
lin(torch.randn(64, 160).bfloat16())
"""


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "vnni" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_vnni(), reason="oneDNN's int8 vector kernels need AVX512-VNNI/AVX-VNNI")
def test_w8a8_gemm_runs_a_vector_kernel_not_onednns_reference():
    """oneDNN multiplies int8 activations in its scalar reference kernel (`ref_int8`, ~1000x
    slower than its VNNI one at 64 rows: 813 ms for SmolLM2's qkv on an AMD EPYC); only uint8
    activations with a zero point reach the vector kernels. Its verbose log names the kernel."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    run = subprocess.run(
        [sys.executable, "-c", W8A8_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    matmuls = [line for line in run.stdout.splitlines() if ",exec," in line and ",matmul," in line]
    assert matmuls, f"oneDNN logged no matmul: {run.stdout[-2000:]}"
    assert not [line for line in matmuls if ",ref" in line], "\n".join(matmuls)
    assert all("src:u8" in line for line in matmuls), "\n".join(matmuls)


def test_gemm_bench_times_every_kernel_at_every_row_count(tmp_path):
    import json

    from baton.bench import gemm

    out = tmp_path / "gemm.json"
    assert gemm.main(["--rows", "1,8", "--num-layers", "2", "--repeats", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["ms_per_pass"]) == {"1", "8"}
    for row in result["ms_per_pass"].values():
        assert set(row) == set(gemm.available_kernels()) and all(ms > 0 for ms in row.values())
    with pytest.raises(SystemExit):
        gemm.main(["--kernels", "int4"])


if __name__ == "__main__":
    run_triton_cases()
