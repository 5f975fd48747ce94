"""Triton paged decode attention vs the torch reference on a CUDA GPU (compiled, not interpreted)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (batch, heads, kv_heads, head_dim, block_size, context_lens, strided_6d_cache)
CASES = [
    (1, 4, 1, 32, 16, [1], False),
    (5, 8, 2, 64, 16, [1, 16, 17, 50, 64], True),
    (5, 6, 2, 48, 32, [31, 32, 33, 1, 70], False),
    (4, 32, 8, 128, 16, [1, 255, 256, 1000], True),  # Llama-like: G=4, D=128
    (3, 14, 2, 64, 32, [7, 64, 513], True),  # G=7 (padded to 16)
    (2, 4, 4, 128, 16, [0, 33], False),  # MHA and an empty context
]
TOLERANCES = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _make_case(case, dtype, seed):
    batch, num_heads, num_kv, head_dim, bs, lens, strided_cache = case
    gen = torch.Generator().manual_seed(seed)
    n_blocks_per_seq = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(n_blocks_per_seq) + 3
    if strided_cache:  # [num_blocks, num_layers, 2, KV, bs, D], layer 1
        full = torch.randn(num_blocks, 3, 2, num_kv, bs, head_dim, generator=gen).to("cuda", dtype)
        k_cache, v_cache = full[:, 1, 0], full[:, 1, 1]
    else:
        k_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to("cuda", dtype)
        v_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to("cuda", dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to("cuda", dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((batch, max(n_blocks_per_seq) + 1), -1, dtype=torch.int32)
    for b, nb in enumerate(n_blocks_per_seq):
        block_tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables.cuda(), context_lens.cuda(), head_dim**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case_idx", range(len(CASES)))
def test_matches_reference_on_gpu(dtype, case_idx):
    pytest.importorskip("triton")
    from baton.kernels.reference import paged_decode_attention_ref
    from baton.kernels.triton_decode import paged_decode_attention_triton

    q, k, v, bt, cl, scale = _make_case(CASES[case_idx], dtype, seed=case_idx)
    out = paged_decode_attention_triton(q, k, v, bt, cl, scale)
    ref = paged_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), cl.cpu(), scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
