"""What rank 0 tells the other ranks each step, over a pipe to each: length-prefixed pickles
whose tensors travel as numpy arrays (bf16 viewed as int16).

The pipe, not a collective, carries the commands: a rank waits on it for as long as its engine is
idle without a collective's timeout, and its end of file tells the rank that rank 0 has gone.
The channel never leaves the worker's own processes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: Any  # AttentionMetadata
    cache_shape: tuple[int, ...]
    """Rank 0's KV cache shape; a rank's own has its KV heads in place of rank 0's."""
    cache_dtype: torch.dtype


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor  # [M, hidden]
    greedy: bool
    """Argmax ids only (``greedy_tokens``), not the whole rows (``compute_logits``)."""


@dataclass(frozen=True)
class StageForward:
    """A pipeline-parallel step: every stage runs its layers over each micro-batch in turn."""

    batches: tuple[Any, ...]  # pipeline_parallel.MicroBatch
    cache_shape: tuple[int, ...]
    """Rank 0's KV cache shape; a rank's own has its layers and KV heads in place of rank 0's."""
    cache_dtype: torch.dtype


@dataclass(frozen=True)
class BusyIntervals:
    """Answer with this rank's recent busy intervals (one JSON line on its stdout)."""


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class _Array:
    data: np.ndarray
    dtype: str


def _pack(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            return _Array(t.view(torch.int16).numpy(), "bfloat16")
        return _Array(t.numpy(), str(t.dtype).removeprefix("torch."))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: _pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, tuple):
        return tuple(_pack(x) for x in obj)
    return obj


def _unpack(obj, device: str):
    if isinstance(obj, _Array):
        t = torch.from_numpy(obj.data)
        t = t.view(torch.bfloat16) if obj.dtype == "bfloat16" else t
        return t.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: _unpack(getattr(obj, f.name), device) for f in dataclasses.fields(obj)})
    if isinstance(obj, tuple):
        return tuple(_unpack(x, device) for x in obj)
    return obj


def encode(message) -> bytes:
    body = pickle.dumps(_pack(message), protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_body(fd: int) -> bytes | None:
    head = _read_exact(fd, _LEN.size)
    return None if head is None else _read_exact(fd, _LEN.unpack(head)[0])


def read(fd: int, device: str):
    """The next message from ``fd``, or None at end of file (rank 0 has gone)."""
    body = _read_body(fd)
    return None if body is None else _unpack(pickle.loads(body), device)


def send_object(fd: int, obj: Any) -> None:
    """Any picklable ``obj`` down ``fd``, framed like the messages (no tensors inside)."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    write(fd, _LEN.pack(len(body)) + body)


def read_object(fd: int) -> Any:
    """The next ``send_object`` on ``fd``, or None at end of file (the other side has gone)."""
    body = _read_body(fd)
    return None if body is None else pickle.loads(body)
