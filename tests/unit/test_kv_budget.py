"""The KV cache as a fraction of a GPU's memory (``gpu_memory_utilization``): the arithmetic and
where the option is refused."""

from __future__ import annotations

import pytest

from baton.common.engine.kv_budget import check_gpu_memory_utilization, gpu_kv_cache_bytes

GIB = 2**30


def test_the_cache_gets_the_fraction_less_what_is_in_use():
    # An 80 GiB GPU at 0.9 is 72 GiB; 20 GiB of weights and context leave 52 GiB.
    assert gpu_kv_cache_bytes(0.9, 80 * GIB, 20 * GIB) == 52 * GIB
    assert gpu_kv_cache_bytes(1.0, 1000, 999) == 1
    assert gpu_kv_cache_bytes(0.5, 1001, 0) == 500  # int(500.5): never over the fraction


@pytest.mark.parametrize("in_use", [72 * GIB, 75 * GIB])
def test_no_room_left_for_the_cache_is_an_error_that_says_why(in_use):
    with pytest.raises(
        ValueError, match=r"0.9 leaves no memory for the KV cache: 0.9 x 80.00 GiB is 72.00 GiB"
    ):
        gpu_kv_cache_bytes(0.9, 80 * GIB, in_use)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_fraction_in_the_unit_interval_is_taken_on_a_gpu(device):
    for u in (None, 0.01, 0.9, 1.0):
        check_gpu_memory_utilization(u, device)
    check_gpu_memory_utilization(None, "cpu")  # off: kv_cache_gib sizes the cache


@pytest.mark.parametrize("u", [0.0, -0.5, 1.01, 90.0])
def test_a_fraction_out_of_bounds_is_refused(u):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        check_gpu_memory_utilization(u, "cuda")


def test_the_cpu_and_data_parallel_replicas_are_refused():
    with pytest.raises(ValueError, match="on device 'cpu' give kv_cache_gib"):
        check_gpu_memory_utilization(0.9, "cpu")
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        check_gpu_memory_utilization(0.9, "cuda", data_parallel_size=2)
