"""The CPU paged decode attention kernel (C++ extension) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.cpu_ops import load, paged_decode_attention
from baton.kernels.reference import paged_decode_attention_ref

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module", autouse=True)
def _built():
    load()  # JIT build once (slow the first time on a machine)


def make_case(
    batch, num_heads, num_kv, head_dim, bs, lens, dtype, *, strided_cache=False, strided_q=False, seed=0
):
    """Random inputs; block tables are a shuffled slice of all blocks, unused slots are -1."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks_per_seq = [(n + bs - 1) // bs for n in lens]
    max_blocks = max(n_blocks_per_seq) + 2
    num_blocks = sum(n_blocks_per_seq) + 5
    if strided_cache:  # the real cache: [num_blocks, num_layers, 2, KV, bs, D]; take layer 2
        full = torch.randn(num_blocks, 4, 2, num_kv, bs, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = full[:, 2, 0], full[:, 2, 1]
        assert k_cache.stride(0) == 4 * 2 * num_kv * bs * head_dim
    else:
        k_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype)
    if strided_q:  # q as the first part of a fused qkv projection
        q = torch.randn(batch, 3 * num_heads, head_dim, generator=gen).to(dtype)[:, :num_heads]
    else:
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, nb in enumerate(n_blocks_per_seq):
        block_tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5


def lens_for(batch, bs, seed):
    """Context lengths covering 1, exactly a block boundary, boundary +- 1 and odd lengths."""
    fixed = [1, bs, 2 * bs, bs + 1, 3 * bs - 1, 5, 47, 100]
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(1, 6 * bs, (batch,), generator=gen).tolist()
    return (fixed + extra)[:batch]


def check(out, ref, dtype, tol=None):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    tol = TOLERANCES[dtype] if tol is None else tol
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), f"max abs err {err}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("strided_cache", [False, True], ids=["dense", "6d"])
def test_matches_reference(dtype, bs, batch, strided_cache):
    lens = lens_for(batch, bs, seed=batch * 100 + bs)
    args = make_case(batch, 9, 3, 64, bs, lens, dtype, strided_cache=strided_cache, seed=batch)
    check(paged_decode_attention(*args), paged_decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,num_kv,head_dim,bs",
    [
        (4, 1, 32, 16),  # G=4, D=32: portable path
        (8, 2, 64, 16),  # G=4
        (2, 2, 64, 32),  # MHA, G=1
        (6, 2, 128, 16),  # G=3, D=128
        (10, 2, 64, 16),  # G=5: portable path
        (6, 2, 48, 8),  # D=48, block size 8: portable path
        (9, 3, 64, 24),  # block size not a multiple of 16
    ],
)
def test_other_shapes(dtype, num_heads, num_kv, head_dim, bs):
    lens = [1, bs, bs + 1, 3 * bs - 1, 77]
    args = make_case(5, num_heads, num_kv, head_dim, bs, lens, dtype, strided_cache=True, seed=bs)
    check(paged_decode_attention(*args), paged_decode_attention_ref(*args), dtype)


def test_float16():
    args = make_case(4, 9, 3, 64, 16, [1, 16, 33, 200], torch.float16, seed=3)
    check(paged_decode_attention(*args), paged_decode_attention_ref(*args), torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_strided_q_out_and_empty_context(dtype):
    q, k, v, bt, cl, scale = make_case(4, 9, 3, 64, 16, [0, 17, 1, 64], dtype, strided_q=True)
    assert not q.is_contiguous()
    ref = paged_decode_attention_ref(q, k, v, bt, cl, scale)
    buf = torch.full((4, 2 * 9, 64), float("nan"), dtype=dtype)[:, 9:]  # strided out
    res = paged_decode_attention(q, k, v, bt, cl, scale, out=buf)
    assert res is buf and not torch.isnan(buf).any()
    assert (buf[0] == 0).all()  # empty context -> zeros, like the reference
    check(buf, ref, dtype)


def test_large_scores_are_stable():
    # Logits in the hundreds exercise the running-max rescale of the streaming softmax; fp32
    # rounding of such logits alone moves the probabilities by ~1e-5 relative, hence the tolerance.
    q, k, v, bt, cl, scale = make_case(3, 9, 3, 64, 16, [300, 47, 129], torch.float32, seed=5)
    q = q * 30
    out = paged_decode_attention(q, k, v, bt, cl, scale)
    check(out, paged_decode_attention_ref(q, k, v, bt, cl, scale), torch.float32, tol=1e-4)


def test_threads_agree():
    """Pairs go to the threads in parts a thread finishing early takes from (``dynamic_for.h``);
    3 threads on 2 cores make it happen. Which thread ran a pair must not show."""
    args = make_case(40, 9, 3, 64, 16, lens_for(40, 16, 9), torch.bfloat16, seed=9)
    assert int(args[4].sum()) * 3 >= 2048  # enough rows for the kernel to split them
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention(*args)
        torch.set_num_threads(max(2, before))
        many = paged_decode_attention(*args)
        torch.set_num_threads(3)
        three = paged_decode_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    assert torch.equal(one, three)


def test_rejects_bad_inputs():
    q, k, v, bt, cl, scale = make_case(3, 9, 3, 64, 16, [5, 16, 40], torch.float32)
    attn = paged_decode_attention
    with pytest.raises(ValueError, match="dtype"):
        attn(q.double(), k.double(), v.double(), bt, cl, scale)
    with pytest.raises(ValueError, match="dtypes must match"):
        attn(q.bfloat16(), k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="int32"):
        attn(q, k, v, bt.long(), cl, scale)
    with pytest.raises(ValueError, match="int32"):
        attn(q, k, v, bt, cl.long(), scale)
    with pytest.raises(ValueError, match=r"q must be \[B, H, D\]"):
        attn(q[0], k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attn(q[:, :7], k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        attn(q[..., :16].contiguous(), k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="block_tables must be"):
        attn(q, k, v, bt[:2], cl, scale)
    with pytest.raises(ValueError, match="context_lens must be"):
        attn(q, k, v, bt, cl[:2], scale)
    with pytest.raises(ValueError, match="contiguous"):
        attn(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, bt, cl, scale)
    with pytest.raises(ValueError, match="contiguous"):
        attn(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="out must be"):
        attn(q, k, v, bt, cl, scale, out=torch.empty_like(q, dtype=torch.bfloat16))
    # Checked in the extension (values, not metadata): never read out of bounds.
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bt, torch.tensor([5, 16, 10_000], dtype=torch.int32), scale)
    bad = bt.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bad, cl, scale)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bad, cl, scale)
