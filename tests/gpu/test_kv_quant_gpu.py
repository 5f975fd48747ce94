"""The quantized-KV Triton decode kernel on a CUDA GPU (compiled, not interpreted) against the torch
reference, and the torch write path (``rope_and_cache_quant`` off the CPU) into a CUDA cache."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import kv_quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

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
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", list(kv_quant.FORMATS.values()), ids=list(kv_quant.FORMATS))
def test_the_write_path_quantizes_into_a_cuda_cache(fmt):
    heads, kv_heads, head_dim, n = 9, 3, 64, 20
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.arange(n)
    freqs = torch.randn(64, head_dim // 2, generator=gen)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    blocks, offsets = torch.arange(n) // 16, torch.arange(n) % 16
    layer = torch.zeros(4, 2, kv_heads, 16, head_dim + 2, dtype=fmt.storage)
    cpu_qkv = qkv.clone()
    kv_quant.rope_and_cache_quant_ref(
        cpu_qkv, positions, cos, sin, layer, blocks, offsets, heads, kv_heads, head_dim
    )
    gpu_layer = torch.zeros_like(layer).cuda()
    args = (positions.cuda(), cos.cuda(), sin.cuda(), gpu_layer, blocks.cuda(), offsets.cuda())
    kv_quant.rope_and_cache_quant(qkv.cuda(), *args, heads, kv_heads, head_dim)
    assert torch.equal(gpu_layer.cpu().view(torch.uint8), layer.view(torch.uint8))
