"""Baton's services as real processes on namespaced hosts (``tests/hosts/netns.py``): Redis, the
gateway, prefill and decode workers, each on its own host, binding and advertising that host's
address. The test's client is a host of its own (the test's thread in its namespace); it talks to
the hosts' addresses only, and never through a proxy the environment may name.

Each host has a port space of its own, so every service takes its usual fixed port: nothing else
can hold it. Workers run a tiny random Llama (``tests/e2e/fault_cluster.py``): the links and the
recovery are the point, not the model. The cluster is reconciled, not rebuilt: ``want()`` stops
the workers a test does not want and starts those it lacks, so one set of hosts serves the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.common.index.server import find_redis_server, ping, server_args
from tests.e2e.fault_cluster import ENGINE_FLAGS, wait_for
from tests.hosts.netns import Host, Network
from tests.procs import die_with_parent

GRPC_PORT, METRICS_PORT, GATEWAY_PORT, REDIS_PORT = 50051, 9100, 8000, 6379
PROGRESS_TIMEOUT_S = 3.0
"""The gateway's ``--stream-progress-timeout``: a stream silent this long has a hung worker."""
START_TIMEOUT_S = 180.0
"""A worker process to load and warm up, with the others starting beside it on 2 cores."""
# KV over TCP only, as between hosts without shared memory or RDMA.
WORKER_ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n", "OMP_NUM_THREADS": "1"}


@dataclass
class Service:
    """One process on one host."""

    name: str
    role: str
    host: Host
    proc: subprocess.Popen
    log: Path
    transport: str = ""
    extra: tuple[str, ...] = ()

    @property
    def grpc_address(self) -> str:
        return f"{self.host.address}:{GRPC_PORT}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{METRICS_PORT}/metrics"

    def metric(self, name: str) -> float:
        """The first series of ``name`` on this worker's /metrics."""
        try:
            body = httpx.get(self.metrics_url, timeout=10, trust_env=False).text
        except httpx.HTTPError as e:
            state = "running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
            raise AssertionError(f"{self.name}'s {self.metrics_url} ({state}): {e}\n{self.tail()}") from e
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)
        assert m, f"{name} not in {self.metrics_url}"
        return float(m.group(1))

    def serving(self) -> bool:
        """Whether its gRPC health check answers SERVING (it must not have exited)."""
        assert self.proc.poll() is None, f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}"
        options = [("grpc.enable_http_proxy", 0)]
        try:
            with grpc.insecure_channel(self.grpc_address, options=options) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """``sig`` (SIGTERM: a drain of ``--drain-timeout 1``), SIGKILL after ``timeout_s``; waits."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Cluster:
    """Redis and the gateway for the module; workers as ``want()`` says."""

    def __init__(self, net: Network, model: Path, logs: Path) -> None:
        self.net, self.model, self.logs = net, model, logs
        self.services: dict[str, Service] = {}
        self._redis_dir = tempfile.mkdtemp(prefix="baton-netns-redis-")
        self.redis_url = ""
        self.base = ""

    # -- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, role: str, argv: list[str], env: dict[str, str] | None = None) -> Service:
        host = self.host(name)
        log = self.logs / f"{name}-{len(list(self.logs.glob(name + '*')))}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                host.argv(*argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.services[name] = Service(name, role, host, proc, log)
        return self.services[name]

    def host(self, name: str) -> Host:
        return self.net.hosts.get(name) or self.net.add_host(name)

    def start_redis(self) -> None:
        address = self.host("redis").address
        self._spawn("redis", "redis", server_args(find_redis_server(), address, REDIS_PORT, self._redis_dir))
        wait_for(lambda: ping(address, REDIS_PORT), 20, f"Redis on {address}:{REDIS_PORT} to answer PING")
        self.redis_url = f"redis://{address}:{REDIS_PORT}/0"

    def start_gateway(self) -> None:
        host = self.host("gateway")
        gateway = self._spawn(
            "gateway",
            "gateway",
            [
                *_baton("gateway"),
                "--host", host.address, "--port", str(GATEWAY_PORT),
                "--model", str(self.model), "--redis-url", self.redis_url,
                "--stream-progress-timeout", str(PROGRESS_TIMEOUT_S), "--drain-timeout", "1",
            ],
            _env({}),
        )  # fmt: skip
        self.base = f"http://{host.address}:{GATEWAY_PORT}"

        def ready() -> bool:
            assert gateway.proc.poll() is None, f"the gateway exited:\n{gateway.tail()}"
            try:
                return httpx.get(f"{self.base}/health", timeout=2, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, START_TIMEOUT_S, f"the gateway at {self.base} to answer /health", 0.2)

    def start_worker(self, name: str, role: str, transport: str, *extra: str) -> Service:
        host = self.host(name)
        argv = [
            *_baton(role),
            "--model", str(self.model), "--redis-url", self.redis_url, "--worker-id", name,
            "--host", host.address, "--advertise-host", host.address,
            "--port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
            "--kv-transport", transport, "--drain-timeout", "1",
        ]  # fmt: skip
        for flag, value in ENGINE_FLAGS.items():
            if flag != "max_model_len":  # the checkpoint's own context length
                argv += [f"--{flag.replace('_', '-')}", str(value)]
        service = self._spawn(name, role, [*argv, *extra], _env(WORKER_ENV))
        service.transport, service.extra = transport, extra
        return service

    def want(self, prefill: dict[str, tuple[str, ...]], decode: dict[str, str]) -> None:
        """Exactly these workers, up and registered: ``prefill`` maps host to extra flags, ``decode``
        host to KV transport. Workers that differ are stopped (drained) first, then the rest start
        side by side."""
        wanted = {n: ("prefill", "ucx", x) for n, x in prefill.items()}
        wanted |= {n: ("decode", t, ()) for n, t in decode.items()}
        for name, s in list(self.services.items()):
            if s.role not in ("prefill", "decode"):
                continue
            if s.proc.poll() is not None or wanted.get(name) != (s.role, s.transport, s.extra):
                s.stop()
                del self.services[name]
        started = [
            self.start_worker(n, role, t, *x) for n, (role, t, x) in wanted.items() if n not in self.services
        ]
        for s in started:
            wait_for(s.serving, START_TIMEOUT_S, f"{s.name} to serve gRPC at {s.grpc_address}", 0.2)
        self.wait_registered(set(prefill), set(decode))

    def wait_registered(self, prefill: set[str], decode: set[str], timeout_s: float = 60.0) -> None:
        """Until the gateway lists exactly these workers, each decode worker connected to each
        prefill worker."""
        seen: dict = {}

        def listed() -> bool:
            nonlocal seen
            try:
                found = httpx.get(f"{self.base}/workers", timeout=2, trust_env=False).json()["workers"]
            except (httpx.HTTPError, KeyError, ValueError):
                return False
            seen = {w["id"]: (w["role"], w["load"].get("prefill_connected")) for w in found}
            return (
                {i for i, (r, _) in seen.items() if r == "prefill"} == prefill
                and {i for i, (r, _) in seen.items() if r == "decode"} == decode
                and all(c == len(prefill) for r, c in seen.values() if r == "decode")
            )

        try:
            wait_for(listed, timeout_s, "the registry", 0.2)
        except AssertionError:
            raise AssertionError(
                f"waited {timeout_s} s for prefill {sorted(prefill)} and decode {sorted(decode)} "
                f"(each connected to every prefill worker) in the gateway's /workers; saw {seen}"
            ) from None

    def discard(self, name: str, settle_s: float = 0.0) -> None:
        """After a partition: SIGKILL the worker on host ``name`` while it is still cut off (so that
        nothing it queued reaches anyone after), put its cable back (its kernel now answers for the
        dead connections with resets), wait ``settle_s``, then remove the host. A worker started
        there again is on a new host with a new address, as a rescheduled pod: the gateway leaves a
        failed worker's address out of routing for 10 s, whoever registers at it."""
        self.services.pop(name).stop(signal.SIGKILL)
        self.net.heal(name)
        time.sleep(settle_s)
        self.net.remove_host(name)

    def close(self) -> None:
        for s in reversed(list(self.services.values())):
            s.stop(signal.SIGKILL)
        self.services.clear()
        shutil.rmtree(self._redis_dir, ignore_errors=True)

    # -- the client -----------------------------------------------------------------------------
    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """A greedy completion of token ids; the whole response."""
        r = httpx.post(
            f"{self.base}/v1/completions", json=body(prompt, max_tokens, False), timeout=120, trust_env=False
        )
        assert r.status_code == 200, (
            r.text + "\n" + "\n".join(f"--- {n}:\n{sv.tail(4000)}" for n, sv in self.services.items())
        )
        return r.json()


def body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


class Stream:
    """One streamed completion, read on its own thread: token ids, when each came, error events."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.times: list[float] = []
        self.errors: list[dict] = []
        self.done = False
        self.finish_reason: str | None = None

    def run(self, base: str, prompt: list[int], max_tokens: int) -> Stream:
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json=body(prompt, max_tokens, True),
            timeout=120,
            trust_env=False,
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    self.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                choice = event["choices"][0]
                ids = choice.get("token_ids") or []
                self.token_ids += ids
                self.times += [time.monotonic()] * len(ids)
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        return self


def _baton(role: str) -> list[str]:
    return [sys.executable, "-m", "baton.cli", role]


def _env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without a Redis URL, UCX settings or proxies (gRPC and httpx would send the
    hosts' traffic to a proxy the environment names), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "REDIS_URL" and not k.startswith("UCX_") and not k.lower().endswith("_proxy")
    }
    return env | extra
