"""The Triton fp8-weight GEMM on a CUDA GPU (compiled, not interpreted) against its fp32 torch
reference, at SmolLM2's shapes and the module that serves ``--quantization fp8`` on a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (M, N, K): decode rows and a prefill chunk at SmolLM2's q|k|v, gate|up, down and LM head shapes.
CASES = [(1, 960, 576), (8, 3072, 576), (64, 576, 1536), (300, 960, 576), (4, 49152, 576)]
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_fp8_linear_matches_reference_on_gpu(case, dtype):
    from baton.common.model.quant import quantize_fp8
    from baton.kernels.triton_quant import fp8_linear, fp8_linear_ref

    m, n, k = case
    gen = torch.Generator().manual_seed(m + n)
    q, scale = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = fp8_linear(x.cuda(), q.cuda(), scale.cuda())
    ref = fp8_linear_ref(x, q, scale)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = TOLERANCES[dtype]
    assert torch.allclose(out.cpu().float(), ref.float(), atol=tol, rtol=tol), (
        (out.cpu().float() - ref.float()).abs().max().item()
    )


def test_fp8_module_runs_the_triton_kernel_on_gpu():
    from baton.common.model.quant import Fp8Linear, quantize_fp8

    w = torch.randn(960, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    lin = Fp8Linear(*quantize_fp8(w), torch.bfloat16, torch.bfloat16).cuda()
    x = torch.randn(16, 576, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    ref = x.float() @ lin.weight_fp32().t()
    assert y.is_cuda and y.dtype == torch.bfloat16
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
