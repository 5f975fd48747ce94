"""What ``baton bench kv-step`` measures (``KVStepConfig``), torch-free: the command (``kv_step``)
builds it from its flags and the timed calls (``kv_step_measure``) read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVStepConfig:
    model: str | None = None
    """A .gguf file or a Llama safetensors directory; None: the default SmolLM2."""
    dtype: str = "bfloat16"
    """Model (and ``auto`` cache) dtype."""
    batch: int = 64
    """Decoding requests in the step."""
    context: int = 4096
    """Tokens each request attends to (its new one included)."""
    block_size: int = 16
    repeats: int = 5
    """Timed calls per measurement (after one warm-up call)."""
    num_layers: int | None = None
    """Keep only this many layers of the model (None: all)."""
    seed: int = 0
