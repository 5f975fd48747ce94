"""Workers' /metrics keep the names the dashboards query, whatever the scraper asks for."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from baton.common.metrics import serve_metrics

# What Prometheus 2.x sends: OpenMetrics first, under which prometheus_client escapes ':' to '_'.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_a_prometheus_scrape_gets_the_names_as_written():
    registry = CollectorRegistry()
    Gauge("baton:num_requests_running", "running", registry=registry).set(3)
    Counter("baton:kv_transfer_bytes", "bytes", registry=registry).inc(7)
    server, thread = serve_metrics(0, "127.0.0.1", registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain;")  # not OpenMetrics
            text = r.read().decode()
    finally:
        server.shutdown()
        thread.join(10)
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["baton:num_requests_running"] == 3
    assert samples["baton:kv_transfer_bytes_total"] == 7
    assert not [name for name in samples if name.startswith("baton_")]
