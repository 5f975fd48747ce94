"""Prometheus metrics, named after vLLM's (``baton:...``). Each service owns a registry.

Engine figures are read at scrape time by a collector (no bookkeeping on the hot path); request
latencies are histograms observed by the service that sees the request's life.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, Summary
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Exports an ``LLMEngine``'s counters and gauges, read when Prometheus scrapes."""

    def __init__(self, engine, labels: dict[str, str]):
        self.engine = engine
        self.labels = labels

    def _g(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _c(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        e = self.engine
        yield from self._queue_and_cache(e)
        yield from self._work(e)
        runner = getattr(e, "runner", None)
        if runner is not None and hasattr(runner, "num_cascade_steps"):
            yield from self._cascade(runner)
        if getattr(e, "structured", None) is not None:
            yield from self._structured(e.structured.stats)
        if getattr(e, "speculator", None) is not None:
            yield from self._spec(e.speculator.stats)

    def _queue_and_cache(self, e):
        """What the worker is: emulated or not; its queue and KV pool; the prefix cache's lookups."""
        config = getattr(e, "config", None)
        emulated = getattr(config, "emulate", None) is not None
        yield self._g(
            "baton:emulated",
            "1: an emulated worker (--emulate): no model runs, step times come from a profile.",
            float(emulated),
        )
        yield self._g("baton:num_requests_running", "Requests in the running batch.", e.scheduler.num_running)
        yield self._g(
            "baton:num_requests_waiting", "Requests waiting to be scheduled.", e.scheduler.num_waiting
        )
        yield self._g("baton:kv_cache_usage_perc", "Fraction of KV blocks in use.", e.pool.usage)
        yield self._g(
            "baton:num_free_blocks", "KV blocks free (cached ones included).", e.pool.num_free_blocks
        )
        yield self._g("baton:num_blocks", "KV blocks in the pool.", e.pool.num_blocks)
        yield self._c(
            "baton:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            e.kv.prefix_cache_queries,
        )
        yield self._c(
            "baton:prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.kv.prefix_cache_hits
        )

    def _work(self, e):
        """Tokens computed and generated, steps and their time, failures and refusals."""
        yield self._c(
            "baton:prompt_tokens_computed",
            "Prompt tokens this worker computed.",
            e.num_prompt_tokens_computed_total,
        )
        structured = getattr(e, "structured", None)
        forced = structured.stats.forced_tokens if structured is not None else 0  # output, not sampled
        yield self._c("baton:generation_tokens", "Tokens generated.", e.num_generated_tokens_total + forced)
        yield self._c("baton:num_preemptions", "Requests preempted.", e.num_preemptions_total)
        yield self._c("baton:engine_steps", "Engine steps run.", e.num_steps_total)
        yield self._c("baton:engine_step_seconds", "Time in engine steps.", e.step_seconds_total)
        yield self._c(
            "baton:engine_forward_seconds",
            "Time in the model's forward pass and sampling (part of the steps).",
            e.forward_seconds_total,
        )
        yield self._c(
            "baton:engine_detokenize_seconds",
            "Time detokenizing output (part of the steps).",
            e.detokenize_seconds_total,
        )
        yield self._c(
            "baton:engine_failed_steps",
            "Engine steps that raised or whose every sampled row was not finite.",
            e.num_failed_steps_total,
        )
        yield self._c(
            "baton:requests_failed",
            "Requests the engine failed (finish reason error).",
            e.num_failed_requests_total,
        )
        yield self._c(
            "baton:requests_refused",
            "Requests refused because the waiting queue was full.",
            e.num_refused_requests_total,
        )

    def _cascade(self, runner):
        """Cascade attention: the decode steps, groups and rows it served."""
        yield self._c(
            "baton:cascade_steps", "Decode steps that used cascade attention.", runner.num_cascade_steps
        )
        yield self._c(
            "baton:cascade_groups",
            "Shared-prefix groups those steps attended.",
            runner.num_cascade_groups,
        )
        yield self._c(
            "baton:cascade_queries",
            "Decode rows served by a shared-prefix pass.",
            runner.num_cascade_queries,
        )

    def _structured(self, stats):
        """Structured outputs: forward steps per output token = sampled / (sampled + forced)."""
        yield self._c(
            "baton:structured_output_sampled_tokens",
            "Structured outputs' sampled tokens.",
            stats.sampled_tokens,
        )
        yield self._c(
            "baton:jump_forward_tokens", "Tokens appended by jump-forward, not sampled.", stats.forced_tokens
        )
        yield self._g(
            "baton:forward_steps_per_output_token",
            "Structured outputs' forward steps per output token since start (1: no jump-forward).",
            stats.forward_steps_per_output_token,
        )

    def _spec(self, stats):
        """vLLM's ``spec_decode`` counters; acceptance rate = accepted / draft tokens, and mean
        accepted length = 1 + accepted / drafts (rates of the counters, on a dashboard)."""
        yield self._c("baton:spec_decode_num_drafts", "Requests verified with proposals.", stats.num_drafts)
        yield self._c("baton:spec_decode_num_draft_tokens", "Tokens proposed.", stats.num_draft_tokens)
        yield self._c(
            "baton:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", stats.num_accepted_tokens
        )
        c = CounterMetricFamily(
            "baton:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position in the proposal.",
            labels=[*self.labels, "position"],
        )
        for pos, n in enumerate(stats.accepted_per_pos):
            c.add_metric([*self.labels.values(), str(pos)], n)
        yield c


class TransferCollector:
    """Exports a KV sender's or receiver's ``stats()`` (``common.transfer.TransferStats``)."""

    def __init__(self, stats, labels: dict[str, str]):
        self.stats = stats
        self.labels = labels

    def collect(self):
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        c = CounterMetricFamily("baton:kv_transfer_bytes", "KV bytes moved between workers.", labels=names)
        c.add_metric(values, s.bytes)
        yield c
        f = CounterMetricFamily("baton:kv_transfer_failures", "KV transfers that failed.", labels=names)
        f.add_metric(values, s.transfers_failed)
        yield f
        t = SummaryMetricFamily("baton:kv_transfer_seconds", "Time spent moving KV.", labels=names)
        t.add_metric(values, count_value=s.transfers_ok, sum_value=s.seconds)
        yield t


class RegistryRejectsCollector:
    """``baton:registry_rejected_records_total``: worker records a registry reader left out because
    their MAC was missing or wrong (``WorkerRegistry.num_rejected``; ``count`` reads it, 0 before
    the registry exists)."""

    def __init__(self, count, labels: dict[str, str]):
        self.count = count
        self.labels = labels

    def collect(self):
        c = CounterMetricFamily(
            "baton:registry_rejected_records",
            "Worker registry records read and ignored: no valid MAC under the cluster secret.",
            labels=list(self.labels),
        )
        c.add_metric(list(self.labels.values()), self.count())
        yield c


class RequestMetrics:
    """Per-request latencies, observed by whoever streams the tokens."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        names = list(labels)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=registry).labels(**labels)

        self.ttft = hist("baton:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("baton:inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("baton:e2e_request_latency_seconds", "Request latency, arrival to last token.")


def stream_handoff(registry: CollectorRegistry, labels: dict[str, str]):
    """A worker's lag from the engine thread handing tokens over to their gRPC chunk leaving the
    servicer (the event loop's share of a served token's latency)."""
    return Summary(
        "baton:stream_handoff_seconds",
        "From the engine thread handing tokens over to their gRPC chunk leaving the servicer.",
        list(labels),
        registry=registry,
    ).labels(**labels)


def serve_metrics(port: int, addr: str, registry: CollectorRegistry) -> tuple[Any, threading.Thread]:
    """``registry`` on ``http://addr:port/metrics`` (any path), in Prometheus' text format whatever
    the scraper asks for; returns ``(server, thread)`` as ``prometheus_client.start_http_server``.

    Why not ``start_http_server``: Prometheus asks for OpenMetrics first, and prometheus_client
    (0.22 and later) then escapes every ``:`` of a name to ``_`` (``baton:num_requests_running``
    becomes ``baton_num_requests_running``), so a real Prometheus stored no series under the names
    the dashboards, alerts and autoscalers query. The text format keeps the names as written, like
    the gateway's ``/metrics``.
    """
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.exposition import ThreadingWSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds
            pass

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, name="baton-metrics", daemon=True)
    thread.start()
    return server, thread
