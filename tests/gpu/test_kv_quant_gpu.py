"""The quantized-KV Triton decode kernel on a CUDA GPU (compiled, not interpreted) against the torch
reference on the CPU: on random caches, and on a cache written by the CUDA write path."""

from __future__ import annotations

import os

import pytest
import torch

from baton.kernels import kv_quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def compiled():
    """Under TRITON_INTERPRET the kernel would run on the host and these tests would say nothing new
    (tests/kernels/test_kv_quant.py runs it so)."""
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "TRITON_INTERPRET is set: nothing compiles"


# (batch, heads, kv_heads, head_dim, block_size, context lengths)
CASES = [
    (5, 9, 3, 64, 16, [1, 16, 17, 100, 0]),
    (4, 32, 8, 128, 16, [1, 255, 256, 1000]),
    (3, 14, 2, 64, 32, [7, 64, 513]),
]


@pytest.mark.parametrize("fmt", list(kv_quant.FORMATS.values()), ids=list(kv_quant.FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_triton_quant_decode_matches_the_reference(fmt, dtype, case):
    from baton.kernels.triton_decode_quant import paged_decode_attention_quant_triton

    batch, heads, kv_heads, head_dim, bs, lens = case
    gen = torch.Generator().manual_seed(0)
    nbs = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nbs) + 3
    dense = torch.randn(num_blocks, 2, 2, kv_heads, bs, head_dim, generator=gen) * 2
    cache = kv_quant.quantize_rows_ref(dense, fmt)[:, 1]  # a layer's view of a 2-layer cache
    tables = torch.randint(0, num_blocks, (batch, max(nbs)), generator=gen, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    ref = kv_quant.paged_decode_attention_quant_ref(q, cache[:, 0], cache[:, 1], tables, ctx, head_dim**-0.5)
    on = cache.cuda()
    out = paged_decode_attention_quant_triton(
        q.cuda(), on[:, 0], on[:, 1], tables.cuda(), ctx.cuda(), head_dim**-0.5
    )
    assert out.is_cuda and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", list(kv_quant.FORMATS.values()), ids=list(kv_quant.FORMATS))
def test_a_cache_written_on_cuda_reads_back_through_the_triton_kernel(fmt):
    """The serving path on a GPU against the torch reference on the CPU: ``rope_and_cache_quant``
    writes the cache, ``paged_decode_attention_quant`` reads it (the Triton kernel, compiled). There
    is no Triton write kernel (on CUDA the write is the reference's torch code), so the written bytes
    only show that torch's casts round alike on both devices; the read is the kernel under test."""
    heads, kv_heads, head_dim, n, bs = 9, 3, 64, 20, 16
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.arange(n)
    freqs = torch.randn(64, head_dim // 2, generator=gen)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    blocks, offsets = torch.tensor([3, 1])[torch.arange(n) // bs], torch.arange(n) % bs  # blocks 3, then 1
    layer = torch.zeros(4, 2, kv_heads, bs, head_dim + kv_quant.SCALE_BYTES, dtype=fmt.storage)
    kv_quant.rope_and_cache_quant_ref(
        qkv.clone(), positions, cos, sin, layer, blocks, offsets, heads, kv_heads, head_dim
    )
    gpu_layer = torch.zeros_like(layer).cuda()
    args = (positions.cuda(), cos.cuda(), sin.cuda(), gpu_layer, blocks.cuda(), offsets.cuda())
    kv_quant.rope_and_cache_quant(qkv.cuda(), *args, heads, kv_heads, head_dim)
    assert torch.equal(gpu_layer.cpu().view(torch.uint8), layer.view(torch.uint8))

    q = torch.randn(2, heads, head_dim, generator=gen)  # [B, H, D]
    tables = torch.tensor([[3, 1], [3, 0]], dtype=torch.int32)  # the second reads block 3 only
    ctx = torch.tensor([n, 5], dtype=torch.int32)
    ref = kv_quant.paged_decode_attention_quant_ref(q, layer[:, 0], layer[:, 1], tables, ctx, head_dim**-0.5)
    out = kv_quant.paged_decode_attention_quant(
        q.cuda(), gpu_layer[:, 0], gpu_layer[:, 1], tables.cuda(), ctx.cuda(), head_dim**-0.5
    )
    assert out.is_cuda and out.shape == q.shape
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
