"""What the fault tests share: a tiny random Llama (the real weights are not the point and would only
make each process slower to start and each prompt slower to compute), workers as real processes
(``baton prefill|decode``, so that they can be killed or stopped) or on an event loop in the test's
process (so that their books can be read), and bounded waits that say what they waited for."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.common.net import free_port
from tests.procs import die_with_parent

T = TypeVar("T")
ENGINE_FLAGS = dict(dtype="float32", kv_cache_gib=0.02, max_num_batched_tokens=64, max_model_len=4096)
"""Every worker's engine: 64-token steps, so a 1,500-token prompt is ~24 chunks sent as it goes."""


def write_tiny_llama(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """``tests/e2e/tiny_llama.py``'s checkpoint with this module's context length."""
    from tests.e2e.tiny_llama import write_tiny_llama as write

    return write(path, hidden=hidden, layers=layers, max_len=ENGINE_FLAGS["max_model_len"], seed=seed)


_TINY: list[Path] = []


def tiny_model() -> Path:
    """One tiny Llama for the whole test session (written on first use, removed at exit)."""
    if not _TINY:
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="baton-tiny-llama-"))
        atexit.register(shutil.rmtree, folder, True)
        _TINY.append(write_tiny_llama(folder / "tiny-llama"))
    return _TINY[0]


def wait_for(check: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.02) -> T:
    """Poll ``check`` until it returns something truthy (returned); fail saying ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(every_s)


def serving(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the gRPC server at ``address`` answers its health check with SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def metric(url: str, name: str) -> float:
    """One sample of a Prometheus endpoint (the first series of ``name``)."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)
    assert m, f"{name} not in {url}"
    return float(m.group(1))


class WorkerProcess:
    """``baton <role>`` in its own session, on fixed free ports; ``wait_ready`` once started."""

    # A free port is free only until another process binds it (the suite's other worker starts
    # clusters too): a worker that fails to bind is started again on new ports, this many times.
    BIND_ATTEMPTS = 3

    def __init__(self, role: str, model: Path, redis_url: str, log_dir: Path, *extra: str) -> None:
        self.role, self.model, self.redis_url, self.log_dir, self.extra = (
            role,
            model,
            redis_url,
            log_dir,
            extra,
        )
        self.attempts = 0
        self._start()

    def _start(self) -> None:
        self.attempts += 1
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.log = self.log_dir / f"{self.role}-{self.grpc_port}.log"
        args = [sys.executable, "-m", "baton.cli", self.role, "--model", str(self.model)]
        args += [
            "--redis-url",
            self.redis_url,
            "--port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        for flag, value in ENGINE_FLAGS.items():
            if flag != "max_model_len":  # the checkpoint's own context length
                args += [f"--{flag.replace('_', '-')}", str(value)]
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*args, *self.extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not serving(self.address):
            if self.proc.poll() is not None and self.attempts < self.BIND_ATTEMPTS:
                if "Address already in use" in self.tail():
                    self._start()
                    continue
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.role} worker did not come up:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGCONT (it may be stopped), SIGTERM, then SIGKILL after 15 s; waits for it."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class LoopThread:
    """An event loop on a thread, for workers that live in the test's process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 180.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class GatewayThread:
    """The real gateway app under uvicorn on a thread of this process; ``stop()`` ends it."""

    def __init__(self, config: Any) -> None:
        from baton.services.gateway.app import make_server

        self.url = f"http://{config.host}:{config.port}"
        self._server = make_server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
