"""``baton autoscaler`` (services/autoscaler.py) on what the real code exposes: the Prometheus text of
the real ``GatewayMetrics`` registry served over HTTP by ``common.metrics.serve_metrics``, and
``/workers`` entries made by the real ``WorkerInfo``. Its own ``/metrics`` is scraped back over HTTP
and parsed: ``baton:desired_replicas{pool}`` keeps its name for KEDA."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cli.main import build_parser
from baton.common.index.registry import WorkerInfo
from baton.common.metrics import serve_metrics
from baton.planner.autoscale import AutoscaleConfig, Autoscaler
from baton.planner.sim_result import SLO
from baton.services.autoscaler import (
    AutoscalerService,
    autoscale_config,
    histogram_quantile,
    observation,
    parse_gateway_metrics,
    pools_from_workers,
)
from baton.services.gateway.metrics import GatewayMetrics
from tests.unit.test_autoscale import decode_heavy_profile


def _traffic(m: GatewayMetrics, n: int, ttft_s: float, itl_s: float, prompt: int, out: int) -> None:
    """``n`` requests through the gateway's own metric calls, as dispatch makes them."""
    for _ in range(n):
        m.in_flight.inc()
        m.latency.ttft.observe(ttft_s)
        m.prompt_tokens.inc(prompt)
        for _ in range(out):
            m.generation_tokens.inc()
        for _ in range(out - 1):
            m.latency.itl.observe(itl_s)
        m.finished("stop")
        m.in_flight.dec()


def _workers(decode_waiting: float, queued: float) -> list[dict]:
    return [
        WorkerInfo(
            "p0", "prefill", "h:1", "kv", "http://h:2/metrics", {"queued_prefill_tokens": queued}
        ).to_dict(),
        WorkerInfo(
            "d0", "decode", "h:3", "", "http://h:4/metrics", {"num_waiting": decode_waiting}
        ).to_dict(),
        WorkerInfo("d1", "decode", "h:5", "", "http://h:6/metrics", {"num_waiting": 1.0}).to_dict(),
    ]


@pytest.fixture
def gateway_metrics():
    """The real gateway registry, served as the gateway serves it (text format)."""
    m = GatewayMetrics("m")
    server, thread = serve_metrics(0, "127.0.0.1", m.registry)
    yield m, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_an_interval_is_read_from_the_gateways_exposition(gateway_metrics):
    m, url = gateway_metrics
    _traffic(m, 10, 0.02, 0.01, 200, 4)
    before = parse_gateway_metrics(_get(url))
    # 100 requests: 50 with a TTFT in (0.01, 0.025], 45 in (0.1, 0.25], 5 in (1, 2.5]; 2 in flight.
    _traffic(m, 50, 0.02, 0.03, 300, 10)
    _traffic(m, 45, 0.2, 0.03, 300, 10)
    _traffic(m, 5, 2.0, 0.03, 300, 10)
    m.in_flight.inc(2)
    after = parse_gateway_metrics(_get(url))
    assert (after.finished, after.in_flight, after.started) == (110, 2, 112)
    pools = pools_from_workers(_workers(3.0, 900.0), ("prefill", "decode"), colocated=False)
    assert pools == {
        "prefill": {"ready": 1, "waiting": 0, "queued_tokens": 900},
        "decode": {"ready": 2, "waiting": 4, "queued_tokens": 0},
    }
    obs = observation(100.0, 10.0, before, after, pools, {"decode": 1})
    assert obs.arrivals == 102
    assert obs.input_len == pytest.approx(300) and obs.output_len == pytest.approx(10)
    # Rank 90 of 100 lies 40/45 of the way through the (0.1, 0.25] bucket.
    assert obs.p90_ttft_ms == pytest.approx(1000 * (0.1 + 0.15 * 40 / 45))
    assert 25.0 < obs.p90_tpot_ms <= 50.0  # every ITL sample was 30 ms: within its (0.025, 0.05] bucket
    assert obs.pools["decode"].starting == 1 and obs.pools["prefill"].queued_tokens == 900
    # Colocated: the decode workers are the one pool.
    colocated = pools_from_workers(_workers(0.0, 0.0), ("colocated",), colocated=True)
    assert colocated["colocated"]["ready"] == 2


def test_histogram_quantile_edges():
    assert histogram_quantile(0.9, [], []) is None
    assert histogram_quantile(0.9, [(1.0, 5), (float("inf"), 5)], [(1.0, 5), (float("inf"), 5)]) is None
    # Everything past the last finite bound: that bound is the answer (Prometheus does the same).
    assert histogram_quantile(0.5, [], [(1.0, 0), (float("inf"), 4)]) == 1.0


def test_the_service_decides_and_exports_desired_replicas_for_keda(gateway_metrics):
    m, url = gateway_metrics
    workers = {"now": _workers(0.0, 0.0)}

    def get(u: str) -> str:
        return json.dumps({"workers": workers["now"]}) if u.endswith("/workers") else _get(u)

    cfg = AutoscaleConfig(bounds={"prefill": (1, 4), "decode": (1, 6)})
    service = AutoscalerService(Autoscaler(decode_heavy_profile(), SLO(500, 50), False, cfg), url, get)
    server, thread = serve_metrics(0, "127.0.0.1", service.registry)
    try:
        assert service.step(now=0.0) is None  # the counters' baseline
        _traffic(m, 120, 0.05, 0.02, 256, 128)  # 12 req/s over the 10 s interval: 2 decode are too few
        d = service.step(now=10.0)
        assert d is not None and d.desired["decode"] >= 4 and d.desired["prefill"] == 1
        exported = {
            s.labels["pool"]: s.value
            for f in text_string_to_metric_families(_get(f"http://127.0.0.1:{server.server_port}/metrics"))
            for s in f.samples
            if s.name == "baton:desired_replicas"
        }
        assert exported == {"prefill": 1.0, "decode": float(d.desired["decode"])}
        # Next interval: the workers asked for are not registered yet: they count as starting,
        # and are not asked for twice.
        _traffic(m, 120, 0.05, 0.02, 256, 128)
        again = service.step(now=20.0)
        assert again.pools["decode"].current == d.desired["decode"]
        assert again.desired["decode"] == d.desired["decode"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_surge_half_an_interval_after_a_decision_is_decided_at_once(gateway_metrics):
    m, url = gateway_metrics
    workers = _workers(0.0, 0.0)  # 1 prefill, 2 decode, nothing waiting
    workers[-1]["load"]["num_waiting"] = 0.0

    def get(u: str) -> str:
        return json.dumps({"workers": workers}) if u.endswith("/workers") else _get(u)

    cfg = AutoscaleConfig(bounds={"prefill": (1, 4), "decode": (1, 6)})
    service = AutoscalerService(Autoscaler(decode_heavy_profile(), SLO(500, 50), False, cfg), url, get)

    def half(n: int, now: float):
        _traffic(m, n, 0.05, 0.02, 256, 128)
        return service.step(now=now)

    assert service.step(now=0.0) is None and service.next_scrape_s() == 5.0
    assert half(30, 5.0) is None  # half-way, and no decision yet to have sized for anything
    assert service.next_scrape_s() == 10.0
    d = half(30, 10.0)  # 6 req/s: 2 decode replicas carry it
    assert d is not None and d.desired["decode"] == 2 and d.sizing_rate == pytest.approx(6.0)
    assert "last 5.0 s at 6.00 req/s" in str(d)
    # A noisy half: 38 in 5 s is 7.6 req/s, 5.1 less 2 sigmas: no surge, no decision.
    assert half(38, 15.0) is None and service.next_scrape_s() == 20.0
    assert half(22, 20.0).desired["decode"] == 2
    # Twice the rate in the next half: decided at once, and the interval clock restarts from it.
    surge = half(60, 25.0)
    assert surge is not None and surge.desired["decode"] >= 4
    assert "surge: decided 5.0 s after the last" in str(surge) and "up now" in str(surge.pools["decode"])
    assert service.decisions[-1] is surge and service.next_scrape_s() == 30.0


def test_the_command_line_sets_bounds_and_refuses_bad_ones():
    a = build_parser().parse_args(
        [
            "autoscaler",
            "--profile",
            "p.json",
            "--slo",
            "ttft:500",
            "--gateway-url",
            "http://g:8000",
            "--max-decode",
            "3",
        ]
    )
    cfg = autoscale_config(a)
    assert cfg.bounds_of("decode") == (1, 3) and cfg.interval_s == 10.0
    bad = build_parser().parse_args(
        [
            "autoscaler",
            "--profile",
            "p.json",
            "--slo",
            "ttft:500",
            "--gateway-url",
            "g",
            "--min-decode",
            "4",
            "--max-decode",
            "2",
        ]
    )
    with pytest.raises(ValueError, match="decode"):
        autoscale_config(bad)
