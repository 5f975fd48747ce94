"""The KV cache's size as a fraction of a GPU's memory (vLLM's ``gpu_memory_utilization``).
Pure: plain numbers in, no torch; the engine measures the device (``engine_build.gpu_memory``)."""

from __future__ import annotations


def check_gpu_memory_utilization(utilization: float | None, device: str, data_parallel_size: int = 1) -> None:
    """ValueError unless ``utilization`` is None (off: ``kv_cache_gib`` sizes the cache) or a
    fraction in (0, 1] of a CUDA device's memory."""
    if utilization is None:
        return
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if not device.startswith("cuda"):
        raise ValueError(
            f"gpu_memory_utilization sizes the KV cache from a GPU's memory; on device {device!r}"
            " give kv_cache_gib (--kv-cache-gib) instead"
        )
    if data_parallel_size > 1:  # the replicas share the device, and each would count the others' caches
        raise ValueError("gpu_memory_utilization with data_parallel_size > 1: give kv_cache_gib instead")


def gpu_kv_cache_bytes(utilization: float, total_bytes: int, in_use_bytes: int) -> int:
    """Bytes the KV cache may take: ``utilization`` of the device's ``total_bytes`` less
    ``in_use_bytes``, what is in use on it once the model is loaded (weights, the CUDA context, any
    other process); the rest, ``1 - utilization``, is left for the activations."""
    budget = int(utilization * total_bytes) - in_use_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache:"
            f" {utilization} x {total_bytes / 2**30:.2f} GiB is {utilization * total_bytes / 2**30:.2f} GiB,"
            f" and {in_use_bytes / 2**30:.2f} GiB is already in use after loading the model;"
            " raise it or use a smaller model"
        )
    return budget
