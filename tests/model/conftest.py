from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def hf_fp32(model_path):
    """transformers' own GGUF loading of the same file: the reference, independent of our loader."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    ).eval()
