"""The fused elementwise CPU ops (C++ extension) vs their torch references.

In fp32 the ops are meant to give torch's eager bits (the engine must stay token-identical to
transformers); that is asserted where torch's own kernels are the ones the extension reproduces
(x86 with torch's AVX2 / AVX-512 kernels), and a 1e-6 relative tolerance is asserted everywhere.
"""

from __future__ import annotations

import platform

import pytest
import torch

from baton.kernels import fused
from baton.kernels.cpu_ops import add_rms_norm, load, rope_and_cache, silu_mul
from baton.kernels.reference import add_rms_norm_ref, rope_and_cache_ref, silu_mul_ref

DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
ROWS = [1, 3, 64, 1000]
EXACT = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2",
    "AVX512",
)
H, KV, D, BS = 9, 3, 64, 16  # SmolLM2-135M attention
HIDDEN, INTER = 576, 1536
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # rtol = atol


@pytest.fixture(scope="module", autouse=True)
def _built():
    load()  # JIT build once (slow the first time on a machine)


def close(out, ref, rtol, atol=0.0):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out.float(), ref.float(), rtol=rtol, atol=atol), f"max abs err {err}"


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    diff = a.contiguous().view(ints) != b.contiguous().view(ints)
    assert not diff.any(), f"{int(diff.sum())} of {a.numel()} differ, first at {diff.nonzero()[0].tolist()}"


def rope_tables(max_pos=4096, head_dim=D, theta=10000.0):
    """cos, sin as transformers' Llama builds them: emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


# --- add_rms_norm -------------------------------------------------------------------------------


def rms_case(n, hidden, delta_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(n, hidden, generator=gen) * 3
    wide = torch.randn(n, hidden + 7, generator=gen)
    # strided delta rows, as a slice of a wider buffer
    delta = None if delta_dtype is None else wide.to(delta_dtype)[:, 3 : 3 + hidden]
    weight = torch.randn(hidden, generator=gen)
    return residual, delta, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", ROWS)
def test_add_rms_norm(dtype, n):
    residual, delta, weight = rms_case(n, HIDDEN, dtype, seed=n)
    res_ref = residual.clone()
    out = torch.full((n, HIDDEN), float("nan"), dtype=dtype)
    ref = torch.empty(n, HIDDEN, dtype=dtype)
    assert add_rms_norm(residual, delta, weight, 1e-5, out) is out
    add_rms_norm_ref(res_ref, delta, weight, 1e-5, ref)
    close(residual, res_ref, rtol=1e-6, atol=1e-6)
    close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
    if EXACT:
        same_bits(residual, res_ref)
        same_bits(out, ref)


@pytest.mark.parametrize("hidden", [1, 7, 8, 100, 512, 1000, 2048, 4099, 8192])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16], ids=["none", "fp32", "bf16"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm_shapes(hidden, delta_dtype, out_dtype):
    """Sizes with vector and scalar tails and with several cascade levels of torch's sum."""
    residual, delta, weight = rms_case(5, hidden, delta_dtype, seed=hidden)
    res_ref = residual.clone()
    out = torch.empty(5, 2 * hidden, dtype=out_dtype)[:, hidden:]  # strided out
    ref = torch.empty(5, hidden, dtype=out_dtype)
    add_rms_norm(residual, delta, weight, 1e-6, out)
    add_rms_norm_ref(res_ref, delta, weight, 1e-6, ref)
    close(residual, res_ref, rtol=1e-6, atol=1e-6)
    close(out, ref, rtol=TOL[out_dtype], atol=TOL[out_dtype])
    if EXACT:
        same_bits(residual, res_ref)
        same_bits(out, ref)


def test_add_rms_norm_rejects_bad_inputs():
    residual, delta, weight = rms_case(4, 64, torch.bfloat16)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(residual.bfloat16(), delta, weight, 1e-5, out)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm(residual.t().contiguous().t(), delta, weight, 1e-5, out)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(residual, delta, weight[:32], 1e-5, out)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(residual, delta, weight.bfloat16(), 1e-5, out)
    with pytest.raises(ValueError, match="out must be"):
        add_rms_norm(residual, delta, weight, 1e-5, out[:3])
    with pytest.raises(ValueError, match="out must be"):
        add_rms_norm(residual, delta, weight, 1e-5, out.half())
    with pytest.raises(ValueError, match="out must be"):
        add_rms_norm(residual, delta, weight, 1e-5, out.t().contiguous().t())
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(residual, delta[:, :32], weight, 1e-5, out)
    with pytest.raises(ValueError, match="delta must be"):
        add_rms_norm(residual, delta.double(), weight, 1e-5, out)


# --- silu_mul -----------------------------------------------------------------------------------


def silu_case(n, inter, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, 2 * inter + 5, generator=gen) * 4
    return wide.to(dtype)[:, 2 : 2 + 2 * inter]  # strided rows


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", ROWS)
def test_silu_mul(dtype, n):
    gate_up = silu_case(n, INTER, dtype, seed=n)
    out = torch.full((n, INTER), float("nan"), dtype=dtype)
    assert silu_mul(gate_up, out) is out
    ref = silu_mul_ref(gate_up)
    # bf16: the reference rounds silu to bf16 before the product, and so does the kernel.
    close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
    if EXACT:  # a multiple of 32: torch vectorizes the whole row
        same_bits(out, ref)


@pytest.mark.parametrize("inter", [1, 7, 16, 100, 96])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul_shapes(inter, dtype):
    gate_up = silu_case(6, inter, dtype, seed=inter)
    out = torch.empty(6, 3 * inter, dtype=dtype)[:, inter : 2 * inter]  # strided out
    silu_mul(gate_up, out)
    ref = silu_mul_ref(gate_up)
    # Tails that torch computes with std::exp may differ by an ulp.
    close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
    if EXACT and inter % 32 == 0:
        same_bits(out, ref)


def test_silu_mul_extremes():
    """The exp's range limits: huge gates, -inf, inf and NaN as torch gives them."""
    gate = torch.tensor([-200.0, -104.5, -103.0, -88.0, -87.0, 0.0, -0.0, 88.0, 89.0, 100.5, 200.0])
    gate = torch.cat(
        [gate, torch.tensor([float("-inf"), float("inf"), float("nan")]), torch.linspace(-120, 120, 18)]
    )
    assert gate.numel() == 32
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1)
    out = torch.empty(1, 32)
    silu_mul(gate_up, out)
    ref = silu_mul_ref(gate_up)
    assert torch.equal(out.isnan(), ref.isnan())
    if EXACT:
        same_bits(out, ref)
    else:
        close(out.nan_to_num(), ref.nan_to_num(), rtol=1e-6)


def test_silu_mul_rejects_bad_inputs():
    gate_up = silu_case(4, 32, torch.float32)
    out = torch.empty(4, 32)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(gate_up[:, :63], out)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(gate_up[0], out)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(gate_up.t().contiguous().t(), out)
    with pytest.raises(ValueError, match="unsupported dtype"):
        silu_mul(gate_up.double(), out.double())
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(gate_up, out.bfloat16())
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(gate_up, out[:, :16])
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(gate_up, out[:3])


# --- rope_and_cache -----------------------------------------------------------------------------


def rope_case(n, dtype, *, num_heads=H, num_kv=KV, head_dim=D, bs=BS, seed=0, max_pos=4096):
    """A fused qkv with strided rows, and a layer's view of a [num_blocks, layers, 2, KV, bs, D]
    cache written at shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv) * head_dim
    qkv = (torch.randn(n, width + 24, generator=gen) * 2).to(dtype)[:, 8 : 8 + width]
    positions = torch.randint(0, max_pos, (n,), generator=gen)
    if n > 1:
        positions[0] = max_pos - 1
    num_blocks = (n + bs - 1) // bs + 3
    cache = torch.randn(num_blocks, 4, 2, num_kv, bs, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n]
    cos, sin = rope_tables(max_pos, head_dim)
    return qkv, positions, cos, sin, cache, slots // bs, slots % bs


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", ROWS)
def test_rope_and_cache(dtype, n):
    qkv, positions, cos, sin, cache, blocks, offsets = rope_case(n, dtype, seed=n)
    assert qkv.stride(0) > qkv.shape[1]
    qkv_ref, cache_ref = qkv.clone(), cache.clone()
    kv_layer, kv_layer_ref = cache[:, 2], cache_ref[:, 2]
    assert kv_layer.stride(0) == 4 * 2 * KV * BS * D
    rope_and_cache(qkv, positions, cos, sin, kv_layer, blocks, offsets, H, KV, D)
    rope_and_cache_ref(qkv_ref, positions, cos, sin, kv_layer_ref, blocks, offsets, H, KV, D)
    if dtype == torch.float32:
        close(qkv, qkv_ref, rtol=1e-6, atol=1e-6)
        close(cache, cache_ref, rtol=1e-6, atol=1e-6)
        same_bits(qkv, qkv_ref)  # separate products and sums in fp32, as the eager ops
        same_bits(cache, cache_ref)
    else:
        # The reference rounds x*cos, rot*sin and their sum to bf16; the kernel rounds once.
        close(qkv, qkv_ref, rtol=1e-2, atol=2e-2)
        close(cache, cache_ref, rtol=1e-2, atol=2e-2)
    # v is copied, the other layers and the untouched slots are left alone
    v_cols = qkv[:, (H + KV) * D :].reshape(n, KV, D)
    assert torch.equal(kv_layer[blocks, 1, :, offsets], v_cols)
    assert torch.equal(kv_layer[blocks, 0, :, offsets], qkv[:, H * D : (H + KV) * D].reshape(n, KV, D))
    untouched = torch.ones(cache.shape[0], BS, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(cache[:, [0, 1, 3]], cache_ref[:, [0, 1, 3]])
    assert torch.equal(
        cache.permute(0, 4, 1, 2, 3, 5)[untouched], cache_ref.permute(0, 4, 1, 2, 3, 5)[untouched]
    )


@pytest.mark.parametrize("n", [1, 64])
def test_rope_bf16_rounds_once(n):
    """bf16: the fp32 product of the bf16 inputs (cos/sin cast to bf16 first), rounded once."""
    qkv, positions, cos, sin, cache, blocks, offsets = rope_case(n, torch.bfloat16, seed=7)
    x = qkv[:, : (H + KV) * D].float().view(n, H + KV, D)
    c = cos[positions].bfloat16().float().unsqueeze(1)
    s = sin[positions].bfloat16().float().unsqueeze(1)
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    expected = (x * c + rot * s).bfloat16().view(n, -1)
    rope_and_cache(qkv, positions, cos, sin, cache[:, 1], blocks, offsets, H, KV, D)
    same_bits(qkv[:, : (H + KV) * D], expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads,num_kv,head_dim,bs", [(4, 4, 128, 8), (6, 2, 40, 5), (2, 1, 2, 1)])
def test_rope_and_cache_shapes(dtype, num_heads, num_kv, head_dim, bs):
    """Other head counts, head dims with a vector tail (20 = 16 + 4, 1), odd block sizes."""
    n = 13
    qkv, positions, cos, sin, cache, blocks, offsets = rope_case(
        n, dtype, num_heads=num_heads, num_kv=num_kv, head_dim=head_dim, bs=bs, seed=head_dim, max_pos=64
    )
    qkv_ref, cache_ref = qkv.clone(), cache.clone()
    args = (positions, cos, sin)
    rope_and_cache(qkv, *args, cache[:, 3], blocks, offsets, num_heads, num_kv, head_dim)
    rope_and_cache_ref(qkv_ref, *args, cache_ref[:, 3], blocks, offsets, num_heads, num_kv, head_dim)
    tol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 2e-2)
    close(qkv, qkv_ref, *tol)
    close(cache, cache_ref, *tol)


def test_rope_and_cache_rejects_bad_inputs():
    qkv, positions, cos, sin, cache, blocks, offsets = rope_case(5, torch.float32)
    kv_layer = cache[:, 0]

    def call(**kw):
        a = dict(
            qkv=qkv, positions=positions, cos=cos, sin=sin, kv_layer=kv_layer, slot_blocks=blocks,
            slot_offsets=offsets, num_heads=H, num_kv_heads=KV, head_dim=D,
        )  # fmt: skip
        a.update(kw)
        rope_and_cache(**a)

    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=qkv[:, :-64])
    with pytest.raises(ValueError, match="qkv must be"):
        call(num_heads=H + 1)
    with pytest.raises(ValueError, match="head_dim"):
        call(head_dim=63)
    with pytest.raises(ValueError, match="unsupported dtype"):
        call(qkv=qkv.double())
    with pytest.raises(ValueError, match="kv_layer dtype"):
        call(qkv=qkv.bfloat16())
    with pytest.raises(ValueError, match="kv_layer must be"):
        call(kv_layer=kv_layer[:, :, :2])
    with pytest.raises(ValueError, match="contiguous in its last three dims"):
        call(kv_layer=kv_layer.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="cos and sin must be"):
        call(cos=cos[:, :32])
    with pytest.raises(ValueError, match="cos and sin must be"):
        call(sin=sin.bfloat16())
    with pytest.raises(ValueError, match="positions must be int64"):
        call(positions=positions.int())
    with pytest.raises(ValueError, match="slot_blocks must be int64"):
        call(slot_blocks=blocks[:4])
    with pytest.raises(ValueError, match="slot_offsets must be int64"):
        call(slot_offsets=offsets.int())
    bad = positions.clone()
    bad[2] = cos.shape[0]
    with pytest.raises(ValueError, match=r"positions\[2\].*out of range"):
        call(positions=bad)
    bad = blocks.clone()
    bad[1] = kv_layer.shape[0]
    with pytest.raises(ValueError, match=r"slot_blocks\[1\].*out of range"):
        call(slot_blocks=bad)
    bad[1] = -1
    with pytest.raises(ValueError, match="out of range"):
        call(slot_blocks=bad)
    bad = offsets.clone()
    bad[4] = BS
    with pytest.raises(ValueError, match=r"slot_offsets\[4\].*out of range"):
        call(slot_offsets=bad)


# --- all ops ------------------------------------------------------------------------------------


def test_empty_batch():
    residual = torch.empty(0, HIDDEN)
    add_rms_norm(residual, torch.empty(0, HIDDEN), torch.ones(HIDDEN), 1e-5, torch.empty(0, HIDDEN))
    silu_mul(torch.empty(0, 2 * INTER), torch.empty(0, INTER))
    qkv, positions, cos, sin, cache, blocks, offsets = rope_case(0, torch.float32)
    rope_and_cache(qkv, positions, cos, sin, cache[:, 0], blocks, offsets, H, KV, D)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_threads_agree(dtype):
    n = 1000
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, max(2, before)):
            torch.set_num_threads(threads)
            residual, delta, weight = rms_case(n, HIDDEN, dtype, seed=1)
            out = torch.empty(n, HIDDEN, dtype=dtype)
            add_rms_norm(residual, delta, weight, 1e-5, out)
            act = silu_mul(silu_case(n, INTER, dtype, seed=2), torch.empty(n, INTER, dtype=dtype))
            qkv, positions, cos, sin, cache, blocks, offsets = rope_case(n, dtype, seed=3)
            rope_and_cache(qkv, positions, cos, sin, cache[:, 1], blocks, offsets, H, KV, D)
            results.append((residual, out, act, qkv, cache))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _topk_ref(x: torch.Tensor, k: int) -> torch.Tensor:
    """Largest first, equal values in index order."""
    return torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 49152), (64, 49152), (5, 100), (2, 17), (4, 8)])
@pytest.mark.parametrize("k", [1, 8])
def test_row_topk_matches_a_stable_sort(dtype, rows, vocab, k):
    """bf16 logits tie often (8 bits of mantissa): ties come out in index order."""
    gen = torch.Generator().manual_seed(rows * vocab + k)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    if vocab >= 100:
        x[0, 37] = x[0, 90] = x.max() + 1  # an exact tie at the top of row 0
    got = fused.row_topk(x, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got, _topk_ref(x, k))


def test_row_topk_strided_rows_and_odd_values():
    x = torch.randn(12, 1000)[::2]  # every other row of a larger buffer
    assert x.stride(0) == 2000
    x[1, :] = 0.0  # all equal: indices 0..k-1
    x[2, 5] = float("nan")  # NaN is never picked
    x[2, 6] = float("inf")
    x[0, -1] = 1e30  # in the scalar tail
    got = fused.row_topk(x, 8)
    assert torch.equal(got[1], torch.arange(8))
    assert 5 not in got[2].tolist() and got[2, 0] == 6
    assert got[0, 0] == 999
    assert torch.equal(got[[0, 3]], _topk_ref(x[[0, 3]], 8))


def test_row_topk_rejects_bad_inputs():
    from baton.kernels import cpu_ops

    with pytest.raises(ValueError, match="k must be"):
        cpu_ops.row_topk(torch.randn(2, 40), 33)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_ops.row_topk(torch.randn(2, 40).half(), 4)
