"""The SDPA prefill that CUDA runs (there is no paged prefill kernel for it) keeps every tensor on
the queries' device. Checked here without a GPU on the ``meta`` device, which refuses a CPU tensor
the way CUDA does: a chunk that continues a cached sequence (a chunked prompt, a prefix hit) built
its block table and causal mask on the CPU, which SDPA refuses for CUDA queries."""

from __future__ import annotations

import torch

from baton.common.model.attention import AttentionMetadata, PrefillSegment, paged_attention, plan_prefills


def test_prefill_on_another_device_builds_its_tensors_there():
    heads, kv_heads, head_dim, bs, dev = 4, 2, 8, 4, "meta"
    chunks = (
        PrefillSegment(start=0, end=6, context_len=10, block_table=(1, 2, 3)),  # 4 tokens cached before
        PrefillSegment(start=6, end=9, context_len=3, block_table=(4,)),  # fresh
    )
    fresh, with_context = plan_prefills(chunks)
    assert with_context == chunks[:1] and len(fresh) == 1

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=dev)

    meta = AttentionMetadata(
        slot_blocks=empty(9, dtype=torch.long),
        slot_offsets=empty(9, dtype=torch.long),
        num_decode_tokens=0,
        decode_block_tables=empty(0, 1, dtype=torch.int32),
        decode_context_lens=empty(0, dtype=torch.int32),
        fresh_runs=fresh,
        context_prefills=with_context,
        prefill_block_tables=empty(2, 3, dtype=torch.int32),
        prefill_context_lens=empty(2, dtype=torch.int32),
        prefill_query_start_loc=empty(3, dtype=torch.int32),
    )
    q, k, v = empty(9, heads, head_dim), empty(9, kv_heads, head_dim), empty(9, kv_heads, head_dim)
    cache = empty(8, kv_heads, bs, head_dim)
    out = paged_attention(q, k, v, cache, cache, meta, head_dim**-0.5)
    assert out.device.type == dev and out.shape == q.shape
