"""``--cpus``: cpu lists and how ``baton up`` shares cores out among workers."""

from __future__ import annotations

import pytest

from baton.services.procs import format_cpu_list, parse_cpu_list, split_cpus
from baton.services.up import _front_cpus


def test_cpu_lists():
    assert parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list("3") == [3]
    assert format_cpu_list([5, 0, 1]) == "0,1,5"
    for bad in ("a", "2-1", "-1", "0-"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)


def test_auto_shares_cores_out_in_order():
    assert split_cpus("auto", 2, [0, 1]) == [[0], [1]]
    assert split_cpus("auto", 1, [0, 1]) == [[0, 1]]
    assert split_cpus("auto", 3, [0, 1, 2, 3]) == [[0, 1], [2], [3]]
    assert split_cpus("auto", 3, [0, 1]) == [[0], [1], [0]]  # more workers than cores


def test_explicit_lists_one_per_worker():
    assert split_cpus("0|1", 2, [0, 1]) == [[0], [1]]
    with pytest.raises(ValueError, match="2 cpu lists for 3 workers"):
        split_cpus("0|1", 3, [0, 1])
    with pytest.raises(ValueError, match="cannot use"):
        split_cpus("0|7", 2, [0, 1])


def test_gateway_and_redis_share_the_prefill_workers_cores():
    assert _front_cpus([[0], [1]], num_prefill=1) == [0]
    assert _front_cpus([[0], [1], [2, 3]], num_prefill=2) == [0, 1]
    assert _front_cpus([[0, 1]], num_prefill=0) == []  # colocated: the front is not pinned
    assert _front_cpus(None, num_prefill=1) == []  # no --cpus
