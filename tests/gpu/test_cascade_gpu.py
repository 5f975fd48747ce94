"""Triton cascade decode attention vs the torch reference on a CUDA GPU (compiled, not
interpreted), and against the plain Triton decode kernel it replaces."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cascade import CASES, check_against_reference, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(dtype):
    from baton.kernels.triton_cascade import cascade_decode_attention_triton

    check_against_reference(cascade_decode_attention_triton, "cuda", [dtype])


def test_matches_plain_triton_decode():
    from baton.kernels.triton_cascade import cascade_decode_attention_triton
    from baton.kernels.triton_decode import paged_decode_attention_triton

    q, k, v, bt, cl, groups, scale = make_case(CASES[4], torch.float32, "cuda", seed=5)
    out = cascade_decode_attention_triton(q, k, v, bt, cl, groups, scale)
    plain = paged_decode_attention_triton(q, k, v, bt, cl, scale)
    torch.testing.assert_close(out, plain, atol=1e-4, rtol=0)
