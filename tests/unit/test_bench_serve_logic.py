"""The arithmetic of ``baton bench serve``: workloads, arrivals, SLOs and the summary."""

from __future__ import annotations

import pytest

from baton.bench.serve import parse_goodput
from baton.bench.serve_client import RequestResult
from baton.bench.serve_report import format_table, is_good, summarize, summarize_w3, summarize_w4
from baton.bench.serve_workload import arrival_delays, trace_requests, w2_requests, w3_requests


def test_w2_is_reproducible_and_in_range():
    a = w2_requests(8, 256, 128, seed=3)
    assert a == w2_requests(8, 256, 128, seed=3)
    assert a != w2_requests(8, 256, 128, seed=4)
    assert all(len(r.prompt_token_ids) == 256 and r.output_len == 128 for r in a)
    assert all(100 <= t < 40000 for r in a for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in a}) == 8


def test_w3_groups_share_exactly_their_prefix():
    reqs = w3_requests(16, 4, 32, 8, 4, seed=0)
    assert len(reqs) == 16
    by_group: dict[int, list] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == [0, 1, 2, 3]
    for rs in by_group.values():
        assert [r.turn for r in rs] == list(range(len(rs)))  # send order within the group
        prefix = rs[0].prompt_token_ids[:32]
        assert all(r.prompt_token_ids[:32] == prefix and len(r.prompt_token_ids) == 40 for r in rs)
        assert len({tuple(r.prompt_token_ids[32:]) for r in rs}) == len(rs)
    prefixes = {tuple(rs[0].prompt_token_ids[:32]) for rs in by_group.values()}
    assert len(prefixes) == 4


def test_poisson_arrivals_have_the_asked_rate():
    gaps = arrival_delays(4000, rate=2.0, burstiness=1.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 0.5) < 0.03
    bursty = arrival_delays(4000, rate=2.0, burstiness=0.25, seed=0)
    assert abs(sum(bursty) / len(bursty) - 0.5) < 0.08
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(bursty) > 2 * var(gaps)  # lower shape: burstier, same mean
    assert arrival_delays(5, float("inf"), 1.0, 0) == [0.0] * 5


def test_goodput_flags():
    assert parse_goodput(["ttft:1500", "tpot:60"]) == {"ttft": 1500.0, "tpot": 60.0}
    for bad in (["ttft"], ["speed:3"], ["tpot:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def _res(ttft, latency, out, **kw) -> RequestResult:
    return RequestResult(success=True, prompt_len=10, output_len=out, ttft=ttft, latency=latency, **kw)


def test_summary_counts_goodput_tpot_and_failures():
    rs = [
        _res(0.1, 1.1, 11, itl=[0.1] * 10),  # tpot 100 ms
        _res(0.2, 0.7, 11, itl=[0.05] * 10),  # tpot 50 ms
        _res(2.0, 2.5, 11, itl=[0.05] * 10),  # ttft too slow
        RequestResult(success=False, error="HTTP 500"),
    ]
    assert rs[0].tpot == pytest.approx(0.1)
    slos = {"ttft": 1500.0, "tpot": 60.0}
    assert [is_good(r, slos) for r in rs] == [False, True, False, False]
    s = summarize(rs, duration=2.0, slos=slos)
    assert (s["completed"], s["failed"], s["num_good"]) == (3, 1, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["total_output_tokens"] == 33 and s["output_throughput"] == pytest.approx(16.5)
    assert s["mean_ttft_ms"] == pytest.approx(766.667, rel=1e-4)
    assert s["median_tpot_ms"] == pytest.approx(50.0)
    assert s["p99_itl_ms"] == pytest.approx(100.0)
    assert s["errors"][3] == "HTTP 500"
    table = format_table(s | {"request_rate": 1.0})
    for line in ("Successful requests:", "Request goodput (req/s):", "P99 TTFT (ms):", "Mean TPOT (ms):"):
        assert line in table
    assert s["total_cached_tokens"] == 0 and "from cache" not in table
    no_slo = summarize(rs, 2.0, {})
    assert no_slo["request_goodput"] is None


def test_summary_reports_prompt_tokens_served_from_cache():
    rs = [_res(0.1, 1.1, 11, cached_tokens=8), _res(0.1, 1.1, 11, cached_tokens=0)]
    rs.append(RequestResult(success=False, cached_tokens=5, error="HTTP 500"))
    s = summarize(rs, duration=2.0, slos={})
    assert s["total_cached_tokens"] == 8
    assert "Input tokens from cache:                8" in format_table(s | {"request_rate": 1.0})


def test_w3_hit_rate_against_the_best_possible():
    rs = [
        _res(1.0, 1.5, 4, turn=0, shared_len=64, cached_tokens=0),
        _res(0.1, 0.5, 4, turn=1, shared_len=64, cached_tokens=64),
        _res(0.3, 0.5, 4, turn=2, shared_len=64, cached_tokens=32),  # a partial hit
    ]
    w3 = summarize_w3(rs)
    assert w3["cacheable_prefix_tokens"] == 128 and w3["cached_prefix_tokens"] == 96
    assert w3["prefix_hit_rate"] == pytest.approx(0.75)
    assert w3["num_hits"] == 1 and w3["cold_over_hit_ttft"] == pytest.approx(10.0)


def test_w4_bytes_per_turn_against_the_new_tokens():
    rs = [
        _res(0.1, 0.5, 4, turn=0, new_len=64, kv_transfer_bytes=64 * 10, kv_bytes_per_token=10),
        _res(0.1, 0.5, 4, turn=1, new_len=64, kv_transfer_bytes=80 * 10, kv_bytes_per_token=10),
    ]
    w4 = summarize_w4(rs)
    assert w4["per_turn"]["1"]["bytes_over_delta"] == pytest.approx(1.0)
    assert w4["per_turn"]["2"]["bytes_over_delta"] == pytest.approx(1.25)
    assert w4["bytes_over_delta"] == pytest.approx(144 / 128)


def test_a_trace_is_replayed_at_its_times_and_lengths():
    rows = [(0.0, 12, 3), (0.25, 40, 7), (1.0, 5, 1)]
    specs, gaps = trace_requests(rows, seed=0)
    assert [len(s.prompt_token_ids) for s in specs] == [12, 40, 5]
    assert [s.output_len for s in specs] == [3, 7, 1]
    assert gaps == pytest.approx([0.0, 0.25, 0.75])  # the loop sleeps each gap, then sends
    assert specs == trace_requests(rows, seed=0)[0]
