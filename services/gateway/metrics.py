"""The gateway's Prometheus metrics: latencies as a client sees them, request and token counts."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Summary

from baton.common.metrics import RequestMetrics


class GatewayMetrics:
    """Owns the gateway's ``CollectorRegistry``. TTFT, ITL and end-to-end latency are observed per
    decode request (one per choice), from the HTTP request's arrival."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.latency = RequestMetrics(self.registry, labels)
        self.http_requests = Counter(
            "baton:http_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.request_success = Counter(
            "baton:request_success",
            "Decode requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "baton:prompt_tokens", "Prompt tokens sent to workers.", ["model_name"], registry=self.registry
        ).labels(**labels)
        self.generation_tokens = Counter(
            "baton:generation_tokens", "Tokens streamed back.", ["model_name"], registry=self.registry
        ).labels(**labels)
        self.in_flight = Gauge(
            "baton:gateway_requests_in_flight",
            "Decode requests this gateway is waiting on.",
            ["model_name"],
            registry=self.registry,
        ).labels(**labels)
        self.chunk_lag = Summary(
            "baton:gateway_chunk_lag_seconds",
            "A chunk's lag behind the engine that produced it: when the gateway received it from the "
            "worker (stage=received) and when it handed its event to the HTTP server (stage=written).",
            ["stage"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "baton:request_migrations",
            "Decode requests resumed on another decode worker after theirs failed mid-stream, by why "
            "(the worker's stream failed, or it sent nothing within the progress deadline).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.admitted = Gauge(
            "baton:gateway_requests_admitted",
            "Generation requests holding an admission slot (a stream holds one until it ends).",
            registry=self.registry,
        )
        self.rejected = Counter(
            "baton:gateway_rejected_requests",
            "Requests refused before any work, by why: over the concurrency limit (concurrency, a "
            "429), a body over the size limit (body_too_large, a 413), no valid API key "
            "(unauthorized, a 401).",
            ["reason"],
            registry=self.registry,
        )
        self._lag_received = self.chunk_lag.labels(stage="received")
        self._lag_written = self.chunk_lag.labels(stage="written")
        self._model_name = model_name

    def chunk_received(self, chunk) -> None:
        if chunk.published_unix_s:
            self._lag_received.observe(time.time() - chunk.published_unix_s)

    def chunk_written(self, chunk) -> None:
        if chunk.published_unix_s:
            self._lag_written.observe(time.time() - chunk.published_unix_s)

    def migrated(self, reason: str) -> None:
        self.migrations.labels(model_name=self._model_name, reason=reason).inc()

    def rejection(self, reason: str) -> Callable[[], None]:
        """What counts one refusal for ``reason``."""
        return self.rejected.labels(reason=reason).inc

    def finished(self, reason: str) -> None:
        self.request_success.labels(model_name=self._model_name, finished_reason=reason or "unknown").inc()
