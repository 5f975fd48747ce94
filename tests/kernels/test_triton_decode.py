"""Triton paged decode attention vs the torch reference, on CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET is read when triton is first imported, and in a full suite another test may have
imported triton already. So the comparison runs in a fresh interpreter (this file run as a script)
with TRITON_INTERPRET=1; PYTHONPATH is passed through from the environment.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # the subprocess below; never flip the pytest process into interpret mode
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess
import sys

import pytest
import torch

# (batch, heads, kv_heads, head_dim, block_size, context_lens, strided_6d_cache, strided_q)
CASES = [
    (1, 4, 1, 32, 16, [1], False, False),  # a single token
    (1, 8, 2, 64, 16, [32], True, False),  # exactly two blocks, 6-D cache slice
    (1, 2, 2, 16, 32, [45], False, True),  # MHA (G=1 padded to 16), q a slice of a qkv tensor
    (5, 8, 2, 32, 16, [1, 16, 17, 50, 64], True, False),  # mixed: 1, boundary, boundary+1, odd
    (5, 6, 2, 48, 32, [31, 32, 33, 1, 70], False, False),  # G=3, D=48 (padded to 64), bs 32
    (2, 4, 2, 16, 16, [0, 5], False, False),  # an empty context gives zeros, like the reference
]


def make_case(case, dtype, device, seed=0):
    """Random inputs for one case: shuffled block tables, unused table slots set to -1."""
    batch, num_heads, num_kv, head_dim, bs, lens, strided_cache, strided_q = case
    gen = torch.Generator().manual_seed(seed)
    n_blocks_per_seq = [(n + bs - 1) // bs for n in lens]
    max_blocks = max(n_blocks_per_seq) + 1
    num_blocks = sum(n_blocks_per_seq) + 3
    if strided_cache:  # the real cache: [num_blocks, num_layers, 2, KV, bs, D]; take layer 1
        full = torch.randn(num_blocks, 3, 2, num_kv, bs, head_dim, generator=gen)
        full = full.to(dtype=dtype, device=device)
        k_cache, v_cache = full[:, 1, 0], full[:, 1, 1]
    else:
        k_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype=dtype, device=device)
        v_cache = torch.randn(num_blocks, num_kv, bs, head_dim, generator=gen).to(dtype=dtype, device=device)
    if strided_q:  # q as the first third of a fused qkv projection
        q = torch.randn(batch, 3 * num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)[
            :, :num_heads
        ]
    else:
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, nb in enumerate(n_blocks_per_seq):
        block_tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables.to(device), context_lens.to(device), head_dim**-0.5


TOLERANCES = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def run_cases(device: str, dtypes) -> None:
    """Compare kernel and reference on every case; raises AssertionError on a mismatch."""
    from baton.kernels.reference import paged_decode_attention_ref
    from baton.kernels.triton_decode import paged_decode_attention_triton

    for dtype in dtypes:
        for i, case in enumerate(CASES):
            q, k, v, bt, cl, scale = make_case(case, dtype, device, seed=i)
            out = paged_decode_attention_triton(q, k, v, bt, cl, scale)
            ref = paged_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), bt.cpu(), cl.cpu(), scale)
            assert out.dtype == dtype and out.shape == q.shape, (out.dtype, out.shape)
            tol = TOLERANCES[dtype]
            err = (out.cpu().float() - ref.float()).abs().max().item()
            assert torch.allclose(out.cpu().float(), ref.float(), atol=tol, rtol=tol), (
                f"{dtype} case {case}: max abs err {err}"
            )
            print(f"ok {dtype} case {i} max_err={err:.2e}")
        # out= is written in place and returned
        q, k, v, bt, cl, scale = make_case(CASES[3], dtype, device, seed=7)
        buf = torch.full_like(q, float("nan"))
        res = paged_decode_attention_triton(q, k, v, bt, cl, scale, out=buf)
        assert res is buf and not torch.isnan(buf).any()


def _run_in_interpreter(dtypes: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__, dtypes],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


# bfloat16 runs with tl.dot operands upcast to fp32: the interpreter's tl.dot multiplies bf16 bit
# patterns (triton-lang/triton#11584). float16 runs the 16-bit tl.dot path the GPU takes.
@pytest.mark.parametrize("dtypes", ["float32", "bfloat16", "float16"])
def test_matches_reference_interpreted(dtypes):
    pytest.importorskip("triton")
    out = _run_in_interpreter(dtypes)
    assert out.count("ok ") == len(CASES), out


def test_wrapper_rejects_bad_inputs():
    pytest.importorskip("triton")
    # Validation runs before the launch, so this needs no interpreter or GPU.
    from baton.kernels.triton_decode import paged_decode_attention_triton as attn

    q, k, v, bt, cl, scale = make_case(CASES[3], torch.float32, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        attn(q.double(), k.double(), v.double(), bt, cl, scale)
    with pytest.raises(ValueError, match="dtypes must match"):
        attn(q.half(), k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="int32"):
        attn(q, k, v, bt.long(), cl, scale)
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
        k_t = k.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, D not innermost
        attn(q, k_t, v, bt, cl, scale)
    with pytest.raises(ValueError, match="contiguous"):
        attn(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, cl, scale)
    with pytest.raises(ValueError, match="out must be"):
        attn(q, k, v, bt, cl, scale, out=torch.empty_like(q, dtype=torch.float16))


if __name__ == "__main__":
    run_cases("cpu", [getattr(torch, name) for name in sys.argv[1].split(",")])
