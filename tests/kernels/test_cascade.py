"""Cascade decode attention: the CPU kernel (C++ extension) and the Triton kernels (interpreted on
CPU) against the torch reference, and the reference against plain paged decode attention.

The Triton comparison runs in a fresh interpreter with TRITON_INTERPRET=1 (this file run as a
script), as tests/kernels/test_triton_decode.py explains.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the subprocess below; never flip the pytest process into interpret mode
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys

import pytest
import torch

from baton.kernels.cascade import cascade_decode_attention_ref, merge_state
from baton.kernels.cascade_groups import CascadeGroups
from baton.kernels.reference import paged_decode_attention_ref

# (heads, kv_heads, head_dim, block_size, groups as (members, shared blocks), own tokens per row)
CASES = [
    (9, 3, 64, 16, [([0, 2, 3], 5), ([4, 5], 4)], [1, 7, 16, 33, 0, 20]),  # SmolLM2 heads; row 1 alone
    (8, 2, 128, 16, [([0, 1, 2, 3, 4], 8)], [1, 2, 3, 40, 100]),  # G=4, D=128
    (4, 4, 64, 32, [([1, 3], 2)], [5, 9, 1, 70]),  # MHA, blocks of 32
    (6, 2, 48, 16, [([0, 1, 2], 3)], [5, 9, 1, 7]),  # D=48: the portable path
    (9, 3, 64, 16, [(list(range(24)), 10)], [1 + 3 * i for i in range(26)]),  # 24 rows: many tiles
    (9, 3, 64, 16, [], [3, 17]),  # no group: plain decode
]
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def make_case(case, dtype, device="cpu", seed=0):
    """Random inputs: each group's rows start with the same shuffled block ids, then blocks of their
    own (``own`` tokens past the shared ones; 0 leaves a row with only shared blocks). The cache is
    a layer's strided view of a 6-D cache; unused table slots are -1."""
    num_heads, num_kv, head_dim, bs, groups, own = case
    batch = len(own)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(n for _, n in groups) + sum((n + bs - 1) // bs for n in own)
    full = torch.randn(num_blocks, 2, 2, num_kv, bs, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = full[:, 1, 0], full[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = [[] for _ in range(batch)]
    lens = [0] * batch
    for members, n in groups:
        shared = [perm.pop() for _ in range(n)]
        for r in members:
            tables[r], lens[r] = list(shared), n * bs
    for b in range(batch):
        tables[b] += [perm.pop() for _ in range((own[b] + bs - 1) // bs)]
        lens[b] += own[b]
    block_tables = torch.full((batch, max(map(len, tables)) + 1), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    to = dict(device=device)
    return (
        q.to(**to), k_cache.to(**to), v_cache.to(**to), block_tables.to(**to), context_lens.to(**to),
        CascadeGroups.build(groups, device), head_dim**-0.5,
    )  # fmt: skip


def check_against_reference(kernel, device: str, dtypes) -> None:
    """``kernel`` against the cascade reference on every case; raises AssertionError."""
    for dtype in dtypes:
        for i, case in enumerate(CASES):
            q, k, v, bt, cl, groups, scale = make_case(case, dtype, device, seed=i)
            out = kernel(q, k, v, bt, cl, groups, scale)
            ref = cascade_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), cl.cpu(), groups, scale)
            assert out.dtype == dtype and out.shape == q.shape
            err = (out.cpu().float() - ref.float()).abs().max().item()
            tol = TOLERANCES[dtype]
            assert err <= tol, f"{dtype} case {i}: max abs err {err}"
            print(f"ok {dtype} case {i} max_err={err:.2e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_exact_attention(dtype):
    # The cascade spelled out in torch equals attention over each row's whole context.
    for i, case in enumerate(CASES):
        q, k, v, bt, cl, groups, scale = make_case(case, dtype, seed=i)
        ref = cascade_decode_attention_ref(q, k, v, bt, cl, groups, scale)
        exact = paged_decode_attention_ref(q, k, v, bt, cl, scale)
        torch.testing.assert_close(ref.float(), exact.float(), atol=TOLERANCES[dtype], rtol=0)


def test_merge_state_of_two_halves_is_the_whole():
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(5, 40, generator=gen) * 4  # scores of 5 rows over 40 keys
    v = torch.randn(40, 8, generator=gen)

    def part(lo, hi):
        lse = torch.logsumexp(s[:, lo:hi], -1)
        return torch.softmax(s[:, lo:hi], -1) @ v[lo:hi], lse

    o, lse = merge_state(*part(0, 13), *part(13, 40))
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    empty = (torch.zeros(5, 8), torch.full((5,), float("-inf")))
    o2, _ = merge_state(*empty, *part(0, 40))
    torch.testing.assert_close(o2, torch.softmax(s, -1) @ v)


def test_cpu_kernel_matches_reference():
    from baton.kernels import cascade

    check_against_reference(cascade.cascade_decode_attention, "cpu", TOLERANCES)


def test_cpu_kernel_equals_plain_kernel_in_fp32():
    # The engine switches between the two per step: in fp32 they agree to rounding.
    from baton.kernels import cascade, cpu_ops

    q, k, v, bt, cl, groups, scale = make_case(CASES[4], torch.float32, seed=11)
    out = cascade.cascade_decode_attention(q, k, v, bt, cl, groups, scale)
    plain = cpu_ops.paged_decode_attention(q, k, v, bt, cl, scale)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)


def test_cpu_kernel_rejects_bad_groups():
    from baton.kernels import cpu_ops

    q, k, v, bt, cl, groups, scale = make_case(CASES[0], torch.float32)

    def run(rows, starts, blocks):
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
        cpu_ops.cascade_decode_attention(q, k, v, bt, cl, i32(rows), i32(starts), i32(blocks), scale)

    with pytest.raises(ValueError, match="does not share block"):
        run([0, 5], [0, 2], [5])  # row 5 holds other blocks
    with pytest.raises(ValueError, match="more than one group"):
        run([0, 2, 0, 3], [0, 2, 4], [5, 5])
    with pytest.raises(ValueError, match="more than row"):
        run([0, 2], [0, 2], [7])  # more blocks than the rows have
    with pytest.raises(ValueError, match="out of range"):
        run([0, 9], [0, 2], [5])
    with pytest.raises(ValueError, match="group_starts must run"):
        run([0, 2], [0, 1], [5])


def _run_in_interpreter(dtypes: str) -> str:
    proc = subprocess.run(
        [sys.executable, __file__, dtypes],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


# bfloat16 runs with tl.dot operands upcast to fp32 in the interpreter (see triton_decode.py).
def test_triton_matches_reference_interpreted():
    pytest.importorskip("triton")
    out = _run_in_interpreter("float32,bfloat16")
    assert out.count("ok ") == 2 * len(CASES), out


def test_the_bench_counts_the_flops_torch_counts_in_the_reference():
    """``attention_flop`` against an independent count: torch's FlopCounterMode over the reference
    attention (its two einsums) on the same batch."""
    from torch.utils.flop_counter import FlopCounterMode

    from baton.bench.cascade import HEAD_DIM, attention_flop, make_batch

    batch = make_batch(3, 64, 20, torch.float32)
    counter = FlopCounterMode(display=False)
    with counter:
        paged_decode_attention_ref(batch.q, batch.k, batch.v, batch.tables, batch.lens, HEAD_DIM**-0.5)
    assert attention_flop(batch) == counter.get_total_flops() == 4 * 9 * 64 * 3 * (64 + 20 + 1)


def test_the_bench_reports_each_kernels_rate_against_the_bf16_peak():
    from baton.bench.cascade import run
    from baton.kernels import cpu_ops

    r = run(requests=4, shared_len=64, suffix_len=8, dtype="bfloat16", iters=2, step=False)
    assert r.attention_gflop == round(4 * 9 * 64 * 4 * (64 + 8 + 1) / 1e9, 4)
    assert r.plain_gflops > 0 and r.cascade_gflops > 0
    if cpu_ops.has_avx512_bf16() and not cpu_ops.has_amx_bf16():
        # vdpbf16ps: 64 flops an instruction; at least 1 GFLOP/s on any thread count here.
        assert r.bf16_peak_gflops is not None and r.bf16_peak_gflops > 1.0
        # the most an exact kernel can gain: the peak over the plain kernel's rate
        assert r.speedup_bound == pytest.approx(r.bf16_peak_gflops / r.plain_gflops, rel=0.03)
    else:
        assert r.bf16_peak_gflops is None and r.speedup_bound is None
    fp32 = run(requests=4, shared_len=64, suffix_len=8, dtype="float32", iters=2, step=False)
    assert fp32.bf16_peak_gflops is None and fp32.speedup_bound is None  # not the fp32 kernels' roof


def test_the_peak_probe_is_zero_without_the_instruction_and_scales_with_rounds():
    from baton.kernels import cpu_ops

    if not cpu_ops.has_avx512_bf16():
        assert cpu_ops.bf16_dot_peak_gflops(1000) == 0.0
        return
    rate = cpu_ops.bf16_dot_peak_gflops(200_000)
    assert 1.0 < rate < 1e5  # a rate in GFLOP/s, not flops or seconds


if __name__ == "__main__":
    from baton.kernels.triton_cascade import cascade_decode_attention_triton

    dtypes = [getattr(torch, name) for name in sys.argv[1].split(",")]
    check_against_reference(cascade_decode_attention_triton, "cpu", dtypes)
