"""The CPU paged prefill attention kernel (C++ extension) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.cpu_ops import load, paged_prefill_attention
from baton.kernels.reference import paged_prefill_attention_ref

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module", autouse=True)
def _built():
    load()  # JIT build once (slow the first time on a machine)


def make_case(
    new_lens,
    ctx_lens,
    dtype,
    *,
    num_heads=9,
    num_kv=3,
    head_dim=64,
    bs=16,
    strided_cache=True,
    strided_q=True,
    seed=0,
):
    """Random inputs for sequences with ``new_lens[s]`` new tokens out of ``ctx_lens[s]`` cached.

    Block tables are a shuffled slice of all blocks, unused slots are -1. strided_cache: the real
    cache layout [num_blocks, num_layers, 2, KV, bs, D], layer 1. strided_q: q is the first part of
    a fused qkv buffer, rows (H + 2 KV) * D apart.
    """
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [(n + bs - 1) // bs for n in ctx_lens]
    max_blocks = max(n_blocks) + 2
    num_blocks = sum(n_blocks) + 5
    if strided_cache:
        full = torch.randn(num_blocks, 3, 2, num_kv, bs, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = full[:, 1, 0], full[:, 1, 1]
        assert k_cache.stride(0) == 3 * 2 * num_kv * bs * head_dim
    else:
        k_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype)
    n = sum(new_lens)
    if strided_q:
        q = torch.randn(n, num_heads + 2 * num_kv, head_dim, generator=gen).to(dtype)[:, :num_heads]
    else:
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    for s, nb in enumerate(n_blocks):
        block_tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(new_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens, qsl, head_dim**-0.5


def reference(q, k_cache, v_cache, block_tables, context_lens, qsl, scale):
    out = torch.zeros_like(q)
    for s in range(len(context_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        if rows.stop > rows.start:
            out[rows] = paged_prefill_attention_ref(
                q[rows], k_cache, v_cache, block_tables[s], int(context_lens[s]), scale
            )
    return out


def check(out, ref, dtype, tol=None):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    tol = TOLERANCES[dtype] if tol is None else tol
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), f"max abs err {err}"


def run_and_check(args, dtype, tol=None):
    check(paged_prefill_attention(*args), reference(*args), dtype, tol)


SCENARIOS = {
    # fresh: context_len == T
    "one_fresh": ([200], [200]),
    "fresh_mixed": ([1, 17, 64, 100, 33, 2], [1, 17, 64, 100, 33, 2]),
    # continuing chunks: T new tokens after cached ones (T = 1, T not a multiple of the block size,
    # context crossing / ending on block boundaries)
    "cached": ([1, 5, 40, 77, 16, 33], [100, 38, 56, 300, 48, 33 + 64]),
    "mixed": ([64, 1, 90], [64, 129, 90 + 250]),
    # one short chunk after a long context: few work items, so smaller query tiles
    "short_after_long": ([40], [600]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_reference(dtype, bs, scenario):
    new_lens, ctx_lens = SCENARIOS[scenario]
    run_and_check(make_case(new_lens, ctx_lens, dtype, bs=bs, seed=bs + len(new_lens)), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_cache_contiguous_q(dtype):
    args = make_case([30, 7], [30, 70], dtype, strided_cache=False, strided_q=False, seed=4)
    assert args[0].is_contiguous()
    run_and_check(args, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "num_heads,num_kv,head_dim,bs",
    [
        (4, 1, 64, 16),  # G=4
        (2, 2, 64, 32),  # MHA, G=1
        (6, 2, 128, 16),  # G=3, D=128
        (10, 2, 64, 16),  # G=5
        (4, 1, 32, 16),  # D=32: portable path
        (6, 2, 48, 8),  # D=48, block size 8: portable path
        (9, 3, 64, 24),  # block size not a multiple of 16
        (9, 3, 64, 1),  # block size 1
    ],
)
def test_other_shapes(dtype, num_heads, num_kv, head_dim, bs):
    args = make_case(
        [45, 1, 20],
        [45, 50, 90],
        dtype,
        num_heads=num_heads,
        num_kv=num_kv,
        head_dim=head_dim,
        bs=bs,
        seed=bs,
    )
    run_and_check(args, dtype)


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (6, 2, 128), (4, 2, 32)])
def test_float16(num_heads, num_kv, head_dim):
    args = make_case(
        [33, 1, 64],
        [33, 40, 130],
        torch.float16,
        num_heads=num_heads,
        num_kv=num_kv,
        head_dim=head_dim,
        seed=3,
    )
    run_and_check(args, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_strided_out_and_uncovered_rows(dtype):
    # Rows 0..2 and the last 4 belong to no sequence; the middle sequence has no new tokens (its
    # block table is never read).
    q, k, v, bt, cl, qsl, scale = make_case([3, 20, 0, 9, 4], [3, 60, 10, 9, 40], dtype, seed=6)
    bt[2] = -1
    inner = torch.tensor([3, 23, 23, 32], dtype=torch.int32)  # sequences 1..3 of the case
    args = (q, k, v, bt[1:4], cl[1:4], inner, scale)
    buf = torch.full((q.shape[0], 2 * q.shape[1], q.shape[2]), float("nan"), dtype=dtype)[
        :, 5 : 5 + q.shape[1]
    ]
    res = paged_prefill_attention(*args, out=buf)
    assert res is buf
    assert torch.isnan(buf[:3]).all() and torch.isnan(buf[32:]).all()
    assert not torch.isnan(buf[3:32]).any()
    ref = reference(q, k, v, bt, cl, qsl, scale)
    check(buf[3:32], ref[3:32], dtype)


def test_large_scores_are_stable():
    # Logits in the hundreds exercise the running-max rescale of the streaming softmax; fp32
    # rounding of such logits alone moves the probabilities by ~1e-5 relative, hence the tolerance.
    q, k, v, bt, cl, qsl, scale = make_case([70, 9], [300, 9], torch.float32, seed=5)
    run_and_check((q * 30, k, v, bt, cl, qsl, scale), torch.float32, tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("growth", [1.0, -1.0], ids=["rising", "falling"])
def test_scores_drifting_along_the_sequence(dtype, growth):
    # Key norms grow (or shrink) with position, so a row's max keeps moving by more than the
    # kernel's lazy-rescale slack (rising) or is set by the first keys (falling).
    q, k, v, bt, cl, qsl, scale = make_case([150, 20], [150, 300], dtype, seed=7)
    bs = k.shape[2]
    for s in range(len(cl)):
        for t in range(int(cl[s])):
            factor = 1 + t / 10 if growth > 0 else 1 + (int(cl[s]) - t) / 10
            k[int(bt[s, t // bs]), :, t % bs] *= factor
    q = q * 2
    tol = 1e-4 if dtype == torch.float32 else None
    run_and_check((q, k, v, bt, cl, qsl, scale), dtype, tol=tol)


def test_long_context_against_decode_style_single_token():
    # T = 1 everywhere: every query sees its whole context (no diagonal masking beyond the end).
    args = make_case([1] * 6, [1, 31, 32, 33, 500, 1000], torch.bfloat16, seed=8)
    run_and_check(args, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_threads_agree(dtype):
    args = make_case([256, 100, 3], [256, 400, 50], dtype, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_prefill_attention(*args)
        torch.set_num_threads(max(2, before))
        many = paged_prefill_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    check(many, reference(*args), dtype)


def test_rejects_bad_inputs():
    q, k, v, bt, cl, qsl, scale = make_case([5, 16, 9], [5, 20, 40], torch.float32)
    attn = paged_prefill_attention
    with pytest.raises(ValueError, match="dtype"):
        attn(q.double(), k.double(), v.double(), bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="dtypes must match"):
        attn(q.bfloat16(), k, v, bt, cl, qsl, scale)
    for i in range(3):
        bad = [bt, cl, qsl]
        bad[i] = bad[i].long()
        with pytest.raises(ValueError, match="int32"):
            attn(q, k, v, *bad, scale)
    with pytest.raises(ValueError, match=r"q must be \[N, H, D\]"):
        attn(q[0], k, v, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attn(q[:, :7], k, v, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        attn(q[..., :16].contiguous(), k, v, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="shapes differ"):
        attn(q, k, v[:, :2], bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="block_tables must be"):
        attn(q, k, v, bt[:2], cl, qsl, scale)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        attn(q, k, v, bt, cl, qsl[:3], scale)
    with pytest.raises(ValueError, match="contiguous"):
        attn(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="contiguous"):
        attn(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, cl, qsl, scale)
    with pytest.raises(ValueError, match="out must be"):
        attn(q, k, v, bt, cl, qsl, scale, out=torch.empty_like(q, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        attn(q, k, v, bt, cl, qsl, scale, out=torch.empty_like(q)[:-1])
    # Checked in the extension (values, not metadata): never read out of bounds.
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bt, torch.tensor([5, 20, 10_000], dtype=torch.int32), qsl, scale)
    with pytest.raises(ValueError, match="out of range"):  # fewer cached tokens than new ones
        attn(q, k, v, bt, torch.tensor([5, 15, 40], dtype=torch.int32), qsl, scale)
    with pytest.raises(ValueError, match="non-decreasing"):
        attn(q, k, v, bt, cl, torch.tensor([0, 5, 3, 30], dtype=torch.int32), scale)
    with pytest.raises(ValueError, match="outside q"):
        attn(q, k, v, bt, cl, qsl + 1, scale)
    bad = bt.clone()
    bad[1, 1] = k.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bad, cl, qsl, scale)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match="out of range"):
        attn(q, k, v, bad, cl, qsl, scale)
