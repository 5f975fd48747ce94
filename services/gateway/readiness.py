"""``/ready``: whether this gateway can serve now, which is whether a decode worker it knows answers.

Not "whether Redis answers": the router keeps its last worker list while Redis is away and routes
on it, so the gateway is ready as long as one of those decode workers says SERVING to a gRPC
health check. The checks are short (``timeout_s``) and their result is reused for ``cache_s``, so
a probe every second costs the workers little and a probe never waits on Redis.

Where a prefill pool is expected (``--expect-prefill N``), the gateway is ready only once its
router's list holds N prefill workers too: before that its requests would name no prefill worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from baton.services.gateway.router import NoWorkerError, Router


@dataclass(frozen=True)
class ReadyState:
    ready: bool
    reason: str
    """Why not, when not."""
    serving: int
    """Decode workers that answered SERVING."""
    known: int
    """Decode workers in the router's list."""
    registry_reachable: bool
    prefill: int = 0
    """Prefill workers in the router's list."""

    def body(self) -> dict:
        registry = "ok" if self.registry_reachable else "unreachable"
        if self.ready:
            return {
                "status": "ready",
                "decode_workers": self.serving,
                "prefill_workers": self.prefill,
                "registry": registry,
            }
        return {"status": "not ready", "reason": self.reason, "registry": registry}


class Readiness:
    """Answers ``/ready`` from the router's workers and their gRPC health."""

    def __init__(
        self, router: Router, timeout_s: float = 0.5, cache_s: float = 1.0, expect_prefill: int = 0
    ) -> None:
        """``expect_prefill``: prefill workers the router must list before the gateway is ready."""
        self._router = router
        self._expect_prefill = expect_prefill
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._state: ReadyState | None = None
        self._checked_at = float("-inf")
        self._probing: asyncio.Task | None = None

    async def check(self) -> ReadyState:
        """The latest answer if younger than ``cache_s``, else a new one (probes at the same moment
        share one check)."""
        if self._state is not None and time.monotonic() - self._checked_at < self._cache_s:
            return self._state
        loop = asyncio.get_running_loop()
        task = self._probing
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._probing = loop.create_task(self._probe())
        return await asyncio.shield(task)

    async def _probe(self) -> ReadyState:
        state = await self._evaluate()
        self._state, self._checked_at = state, time.monotonic()
        return state

    async def _evaluate(self) -> ReadyState:
        try:
            workers = await self._router.decode_workers()
        except NoWorkerError as e:
            return ReadyState(False, str(e), 0, 0, self._router.registry_reachable)
        reachable = self._router.registry_reachable
        if not workers:
            return ReadyState(False, "no decode worker", 0, 0, reachable)
        answers = await asyncio.gather(*(self._serving(w.grpc_address) for w in workers))
        serving = sum(answers)
        if not serving:
            reason = f"none of the {len(workers)} decode workers answers its health check"
            return ReadyState(False, reason, 0, len(workers), reachable)
        prefill = len(self._router.prefill_workers)
        if prefill < self._expect_prefill:
            reason = f"{prefill} of the {self._expect_prefill} prefill workers expected are registered"
            return ReadyState(False, reason, serving, len(workers), reachable, prefill)
        return ReadyState(True, "", serving, len(workers), reachable, prefill)

    async def _serving(self, address: str) -> bool:
        try:
            reply = await self._router.health_stub(address).Check(
                health_pb2.HealthCheckRequest(), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
