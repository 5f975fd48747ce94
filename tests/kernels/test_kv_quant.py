"""The quantized KV cache (``--kv-cache-dtype``): the format's rounding, and the CPU kernels that
write it (rope_and_cache_quant), read it in place (paged_decode_attention_quant) and dequantize it
for the prefill kernel, each against the torch references of ``baton.kernels.kv_quant`` in fp32."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import cpu_ops, kv_quant, kv_rows
from baton.kernels.reference import paged_prefill_attention_ref, rope_and_cache_ref

FORMATS = list(kv_quant.FORMATS.values())
IDS = [f.name for f in FORMATS]
MANTISSA = {"int8": None, "fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}
"""Mantissa bits and smallest normal exponent of each fp8 format."""


@pytest.fixture(scope="module", autouse=True)
def _built():
    cpu_ops.load()


def _rows(gen: torch.Generator, n: int, d: int) -> torch.Tensor:
    """Rows of widely varying magnitude (1e-3 .. 1e3), with one all-zero row and one outlier."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-3, 3, n).unsqueeze(1)
    x[0] = 0.0
    x[1, 3] = 1e4
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_dequantized_values_are_within_their_formats_rounding(fmt):
    x = _rows(torch.Generator().manual_seed(0), 64, 64)
    rows = kv_quant.quantize_rows_ref(x, fmt)
    assert rows.dtype == fmt.storage and rows.shape == (64, 66)
    back = kv_quant.dequantize_rows_ref(rows)
    _, scales = kv_rows.split_rows(rows)
    s = scales.float().unsqueeze(1)
    assert torch.equal(back[0], torch.zeros(64)), "a zero row stays zero"
    if fmt.name == "int8":
        bound = s / 2  # half a step of the row's scale
    else:
        mant, emin = MANTISSA[fmt.name]
        # half an ulp of the value's own binade, or of the subnormal step below the normals
        bound = x.abs() * 2.0 ** -(mant + 1) + s * 2.0 ** (emin - mant - 1)
    err = (back - x).abs()
    assert (err <= bound * (1 + 1e-6) + 1e-30).all(), (err / bound.clamp_min(1e-30)).max()
    # each row uses its whole range: its largest magnitude maps to about qmax codes
    codes, _ = kv_rows.split_rows(rows[1:])
    assert (codes.float().abs().amax(1) >= fmt.qmax * 0.99).all()


def _rope_case(dtype, heads, kv_heads, head_dim, n=37, num_blocks=20, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 100, (n,), generator=gen)
    freqs = torch.randn(200, head_dim // 2, generator=gen)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n]
    return qkv, positions, cos, sin, slots // bs, slots % bs


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 32)])
def test_rope_and_cache_quant_writes_the_reference_codes(fmt, dtype, shape):
    heads, kv_heads, head_dim = shape
    qkv, positions, cos, sin, blocks, offsets = _rope_case(dtype, *shape)
    # a layer's strided view of the whole block-major cache, as the model passes it
    cache = torch.zeros(20, 3, 2, kv_heads, 16, head_dim + 2, dtype=fmt.storage)
    ours = cache[:, 1]
    ref_qkv, ref_layer = qkv.clone(), torch.zeros_like(ours)
    cpu_ops.load().rope_and_cache_quant(qkv, positions, cos, sin, ours, blocks, offsets, *shape)
    kv_quant.rope_and_cache_quant_ref(ref_qkv, positions, cos, sin, ref_layer, blocks, offsets, *shape)
    if dtype == torch.float32:  # the rotation is rope_and_cache's: fp32 bits are torch's
        assert torch.equal(qkv, ref_qkv)
        assert torch.equal(ours.view(torch.uint8), ref_layer.view(torch.uint8))
    # bf16 rotations may differ from eager's by an ulp: the codes are those of the kernel's own rotation
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(-1, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(-1, kv_heads, head_dim)
    raw = ours.view(torch.uint8)
    assert torch.equal(raw[blocks, 0, :, offsets], kv_quant.quantize_rows_ref(k, fmt).view(torch.uint8))
    assert torch.equal(raw[blocks, 1, :, offsets], kv_quant.quantize_rows_ref(v, fmt).view(torch.uint8))
    untouched = torch.ones(20, 16, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert not raw.permute(0, 3, 1, 2, 4)[untouched].any(), "only the given slots are written"


def test_rope_and_cache_quant_matches_the_dense_rotation():
    """The rotated q is rope_and_cache's own (the quantized path rotates the same way)."""
    shape = (9, 3, 64)
    qkv, positions, cos, sin, blocks, offsets = _rope_case(torch.bfloat16, *shape)
    dense_qkv = qkv.clone()
    cache = torch.zeros(20, 2, 3, 16, 66, dtype=torch.int8)
    cpu_ops.load().rope_and_cache_quant(qkv, positions, cos, sin, cache, blocks, offsets, *shape)
    cpu_ops.rope_and_cache(
        dense_qkv, positions, cos, sin, torch.zeros(20, 2, 3, 16, 64, dtype=torch.bfloat16), blocks, offsets,
        *shape,
    )  # fmt: skip
    assert torch.equal(qkv, dense_qkv)


def _quant_cache(fmt, num_blocks, kv_heads, bs, head_dim, gen, layers=3, layer=1):
    """A layer's K and V views of a random quantized block-major cache (real quantized rows)."""
    dense = torch.randn(num_blocks, layers, 2, kv_heads, bs, head_dim, generator=gen) * 2
    cache = kv_quant.quantize_rows_ref(dense, fmt)
    return cache[:, layer, 0], cache[:, layer, 1]


# (batch, heads, kv_heads, head_dim, block_size, context lengths): the AVX-512 cases (G 1-4, D 32/64/128),
# and the portable path (D 48, G 6)
DECODE_CASES = [
    (5, 9, 3, 64, 16, [1, 16, 17, 100, 0]),
    (3, 4, 2, 32, 16, [33, 5, 64]),
    (2, 4, 4, 128, 32, [70, 1]),
    (4, 8, 2, 64, 16, [300, 2, 48, 129]),
    (2, 6, 1, 48, 16, [20, 41]),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention_reads_the_quantized_cache_like_the_reference(fmt, dtype, case):
    batch, heads, kv_heads, head_dim, bs, lens = case
    gen = torch.Generator().manual_seed(1)
    nbs = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nbs) + 4
    k_cache, v_cache = _quant_cache(fmt, num_blocks, kv_heads, bs, head_dim, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((batch, max(nbs) + 1), -1, dtype=torch.int32)
    for b, nb in enumerate(nbs):
        tables[b, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    context = torch.tensor(lens, dtype=torch.int32)
    out = kv_quant.paged_decode_attention_quant(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    ref = kv_quant.paged_decode_attention_quant_ref(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    if kv_quant.uses_integer_kernel(k_cache, heads // kv_heads, head_dim):
        # int8 q and softmax weights too: the exact emulation, tightly; the fp32 reference to
        # within those roundings (a few 1/255 steps of the weights, 1/254 of q's range)
        ref8 = kv_quant.paged_decode_attention_int8_ref(q, k_cache, v_cache, tables, context, head_dim**-0.5)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref8.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(out.float(), ref.float(), atol=4e-2, rtol=4e-2)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert not out[[i for i, n in enumerate(lens) if n == 0]].any(), "an empty context gives zeros"


def test_int8_integer_kernel_rounding_is_bounded_on_long_peaked_contexts():
    """The 8-bit softmax weights are scaled per 16 rows, so a long tail of small weights far below
    the largest (a peaked softmax over 2,000 rows) keeps its mass: the output stays within the
    int8 roundings of the fp32 reference."""
    gen = torch.Generator().manual_seed(7)
    group, kv_heads, head_dim, bs, n = 3, 3, 64, 16, 2000
    nb = n // bs + 1
    dense = torch.randn(nb, 1, 2, kv_heads, bs, head_dim, generator=gen)
    dense[0, 0, 0, :, 3] *= 6  # one row of K far above the rest: its score dominates
    cache = kv_quant.quantize_rows_ref(dense, kv_quant.FORMATS["int8"])
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    tables = torch.arange(nb, dtype=torch.int32).unsqueeze(0)
    peak = dense[0, 0, 0, :, 3]  # [KV, D]
    # its score 8 above the others': it weighs about as much as the 2,000 others together
    q = (peak * (8 / (peak.square().sum(-1, keepdim=True) * head_dim**-0.5))).repeat_interleave(group, 0)[
        None
    ]
    context = torch.tensor([n], dtype=torch.int32)
    out = kv_quant.paged_decode_attention_quant(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    ref = kv_quant.paged_decode_attention_quant_ref(q, k_cache, v_cache, tables, context, head_dim**-0.5)
    rel = (out - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


def test_decode_attention_refuses_a_cache_without_room_for_the_scales():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _quant_cache(kv_quant.FORMATS["int8"], 4, 2, 16, 64, gen)
    q = torch.randn(1, 4, 32)  # head_dim 32 against rows of 64 + 2
    with pytest.raises(ValueError, match="do not hold head_dim 32"):
        kv_quant.paged_decode_attention_quant(
            q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="not a quantized KV cache dtype"):
        cpu_ops.load().paged_decode_attention_quant(
            torch.empty(1, 4, 64), torch.randn(1, 4, 64), k_cache.float(), v_cache.float(),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
        )  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_blocks_is_the_reference_dequantization(fmt, dtype):
    k_cache, _ = _quant_cache(fmt, 9, 3, 16, 64, torch.Generator().manual_seed(2))
    ids = torch.tensor([4, 0, 8, 4], dtype=torch.int32)
    out = torch.empty(4, 3, 16, 64, dtype=dtype)
    cpu_ops.load().dequantize_blocks(out, k_cache, ids)
    assert torch.equal(out, kv_quant.dequantize_rows_ref(k_cache[ids.long()], dtype))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_over_the_quantized_cache(fmt, dtype):
    """Chunks with and without cached context, sharing a block, in one call."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    k_cache, v_cache = _quant_cache(fmt, 12, kv_heads, bs, head_dim, gen)
    tables = torch.tensor([[3, 7, 1, -1], [3, 9, -1, -1], [5, -1, -1, -1]], dtype=torch.int32)
    context = torch.tensor([40, 20, 9], dtype=torch.int32)
    new = [8, 20, 9]  # the last tokens of each sequence
    loc = torch.tensor([0, 8, 28, 37], dtype=torch.int32)
    q = torch.randn(37, heads, head_dim, generator=gen).to(dtype)
    out = kv_quant.paged_prefill_attention_quant(q, k_cache, v_cache, tables, context, loc, 0.125)
    k_dense, v_dense = kv_quant.dequantize_rows_ref(k_cache), kv_quant.dequantize_rows_ref(v_cache)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for s in range(3):
        rows = slice(int(loc[s]), int(loc[s + 1]))
        ref = paged_prefill_attention_ref(
            q[rows].float(), k_dense, v_dense, tables[s], int(context[s]), 0.125
        )
        assert new[s] == rows.stop - rows.start
        torch.testing.assert_close(out[rows].float(), ref, atol=tol, rtol=tol)


def test_sdpa_fallback_reads_the_quantized_cache():
    """The device-agnostic path (common/model/attention.py's SDPA prefill) dequantizes as it gathers."""
    from baton.common.model.attention import _gather

    k_cache, _ = _quant_cache(kv_quant.FORMATS["fp8_e4m3"], 6, 2, 16, 32, torch.Generator().manual_seed(4))
    table = torch.tensor([4, 1], dtype=torch.int32)
    got = _gather(k_cache, table, 20, torch.float32)
    assert got.shape == (2, 20, 32)
    want = kv_quant.dequantize_rows_ref(torch.cat([k_cache[4], k_cache[1]], dim=1)[:, :20])
    assert torch.equal(got, want)


def test_the_reference_write_is_rope_and_cache_ref_then_quantization():
    shape = (4, 2, 32)
    qkv, positions, cos, sin, blocks, offsets = _rope_case(torch.float32, *shape)
    fmt = kv_quant.FORMATS["int8"]
    layer = torch.zeros(20, 2, 2, 16, 34, dtype=torch.int8)
    dense = torch.zeros(20, 2, 2, 16, 32)
    q2 = qkv.clone()
    kv_quant.rope_and_cache_quant_ref(qkv, positions, cos, sin, layer, blocks, offsets, *shape)
    rope_and_cache_ref(q2, positions, cos, sin, dense, blocks, offsets, *shape)
    assert torch.equal(qkv, q2)
    assert torch.equal(
        layer[blocks, 0, :, offsets], kv_quant.quantize_rows_ref(dense[blocks, 0, :, offsets], fmt)
    )


# --- the Triton kernel, under TRITON_INTERPRET=1 in a fresh interpreter (see test_triton_decode.py:
# the variable is read when triton is first imported, which another test may have done already)


def _triton_cases(device: str) -> int:
    """Compare the Triton kernel with the reference on every format, model dtype and decode case."""
    from baton.kernels.triton_decode_quant import paged_decode_attention_quant_triton

    n = 0
    for fmt in FORMATS:
        for dtype in (torch.float32, torch.bfloat16):
            for case in DECODE_CASES[: 2 if dtype == torch.float32 else 1]:  # a G=3 and a G=2 case
                batch, heads, kv_heads, head_dim, bs, lens = case
                gen = torch.Generator().manual_seed(n)
                nbs = [(x + bs - 1) // bs for x in lens]
                k_cache, v_cache = _quant_cache(fmt, sum(nbs) + 2, kv_heads, bs, head_dim, gen)
                # blocks may repeat across sequences: attention only reads them
                tables = torch.randint(0, sum(nbs) + 2, (batch, max(nbs)), generator=gen, dtype=torch.int32)
                q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
                ctx = torch.tensor(lens, dtype=torch.int32)
                out = paged_decode_attention_quant_triton(
                    *(t.to(device) for t in (q, k_cache, v_cache, tables, ctx)), head_dim**-0.5
                )
                ref = kv_quant.paged_decode_attention_quant_ref(
                    q, k_cache, v_cache, tables, ctx, head_dim**-0.5
                )
                tol = 2e-5 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
                n += 1
    return n


def test_triton_kernel_matches_the_reference_interpreted():
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert f"ok {len(FORMATS) * 3} cases" in proc.stdout, proc.stdout


if __name__ == "__main__":
    print(f"ok {_triton_cases('cpu')} cases")
