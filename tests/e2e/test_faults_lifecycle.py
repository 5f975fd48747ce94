"""How services leave and come back: a decode worker drains on SIGTERM (its streams complete, it
leaves the registry at once, it exits 0), a drain deadline ends what is left with UNAVAILABLE, a
dead engine takes its worker out of service and asks for a non-zero exit, the gateway finishes an
open stream on SIGTERM, and ``baton up`` restarts what dies and drains everything on SIGTERM.

Real processes, real gRPC, a real Redis and a tiny random Llama (the plumbing is the point, not
the weights); every process runs one torch thread, which on a shared 2-core machine is the
difference between ~4 and ~70 ms per step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.engine.sampling_params import SamplingParams
from baton.common.index.registry import WorkerRegistry
from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.gateway.app import GatewayConfig, make_server
from baton.services.lifecycle import EX_SOFTWARE
from baton.services.worker_base import serve_worker
from tests.e2e.fault_cluster import serving
from tests.e2e.fault_cluster import wait_for as _poll
from tests.e2e.tiny_llama import write_tiny_llama
from tests.e2e.up_process import start_up, stop_up
from tests.procs import die_with_parent

pytestmark = [pytest.mark.slow, pytest.mark.serial]

PROMPTS = [[11, 200, 3000, 45, 9], [700, 701, 702, 703, 704, 705], list(range(100, 140))]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-batched-tokens", "256"]
ENGINE_FLAGS += ["--max-num-seqs", "8"]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("lifecycle") / "tiny"))


@pytest.fixture(scope="module")
def model_name(tiny_model) -> str:
    return Path(tiny_model).name


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process engines on one thread too (restored for the modules after this one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis()
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def registry(redis_url, model_name) -> WorkerRegistry:
    return WorkerRegistry(redis.Redis.from_url(redis_url, socket_timeout=5), model_name, ttl_s=6.0)


@pytest.fixture(scope="module")
def gateway(tiny_model, redis_url):
    """An in-process gateway over the module's Redis."""
    port = free_port()
    server = make_server(GatewayConfig(port=port, model=tiny_model, redis_url=redis_url, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: _answers(f"{url}/health"), 60, "the gateway to answer /health")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# -- helpers -------------------------------------------------------------------------------------
def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def _complete(base: str, body: dict) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _stream(base: str, body: dict, first: threading.Event) -> list[tuple[float, list[int]]]:
    """A streamed completion's ``(arrival, token ids)`` per chunk; ``first`` is set at the first
    token. An error event fails it."""
    got: list[tuple[float, list[int]]] = []
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                ids = chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else []
                got.append((time.monotonic(), ids))
                if ids:
                    first.set()
    return got


def _tokens(chunks: list[tuple[float, list[int]]]) -> list[int]:
    return [t for _, ids in chunks for t in ids]


def _health(address: str) -> int | None:
    """The worker's gRPC health status, None if it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                .status
            )
        except grpc.RpcError:
            return None


def _engine(model: str) -> EngineConfig:
    return EngineConfig(
        model=model, dtype="float32", kv_cache_gib=0.05, max_num_batched_tokens=256, max_num_seqs=8
    )


@contextlib.contextmanager
def _event_loop():
    """An event loop running on its own thread, stopped after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@contextlib.contextmanager
def _in_process(config: DecodeWorkerConfig):
    """A decode worker on its own event loop thread: ``(worker, loop)``."""
    with _event_loop() as loop:
        worker = DecodeWorker(config)
        try:
            asyncio.run_coroutine_threadsafe(worker.start(), loop).result(timeout=120)
            yield worker, loop
        finally:
            asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)


def _generate(stub, request_id: str, prompt: list[int], max_tokens: int, timeout: float = 120):
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    request = baton_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params)
    return stub.Generate(request, timeout=timeout)


def _start_decode(
    model: str, redis_url: str, worker_id: str, drain_s: float, log: Path, *extra: str
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "baton.cli", "decode", "--model", model, *ENGINE_FLAGS, *extra]
    cmd += [
        "--redis-url",
        redis_url,
        "--colocated",
        "--worker-id",
        worker_id,
        "--drain-timeout",
        str(drain_s),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ONE_THREAD},
            preexec_fn=die_with_parent,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


# -- a decode worker process drains on SIGTERM ---------------------------------------------------
def test_sigterm_drains_a_decode_worker(tiny_model, model_name, redis_url, registry, gateway, tmp_path):
    """Streams in flight complete, token for token, on the only decode worker; it leaves the
    registry at once and reports NOT_SERVING, so a new request is not served there (503: no decode
    worker); then it exits 0 well within its drain timeout."""
    log = tmp_path / "decode.log"
    proc = _start_decode(tiny_model, redis_url, "drain-a", drain_s=60, log=log)
    try:
        info = _poll(lambda: registry.get("drain-a") or proc.poll(), 120, "the decode worker to register")
        assert proc.poll() is None, log.read_text()[-3000:]
        _poll(lambda: _answers(f"{gateway}/ready"), 30, "the gateway to see the worker")
        bodies = [_body(model_name, p, 400, stream=True) for p in PROMPTS]
        with ThreadPoolExecutor(len(bodies)) as pool:
            want = list(pool.map(lambda b: _complete(gateway, b), bodies))
            firsts = [threading.Event() for _ in bodies]
            streams = [pool.submit(_stream, gateway, b, e) for b, e in zip(bodies, firsts)]
            assert all(e.wait(60) for e in firsts), "the streams did not start"
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            _poll(lambda: registry.get("drain-a") is None, 5, "the worker to leave the registry")
            left = time.monotonic()
            assert left - signalled < 2.0
            assert _health(info.grpc_address) == NOT_SERVING
            late = httpx.post(
                f"{gateway}/v1/completions", json=_body(model_name, PROMPTS[0], 4, False), timeout=30
            )
            assert late.status_code == 503, late.text
            assert set(late.json()["error"]) >= {"message", "type", "code"}
            got = [s.result(timeout=120) for s in streams]
        for chunks, tokens in zip(got, want):
            assert _tokens(chunks) == tokens
            assert any(ids and at > left for at, ids in chunks), "a stream had ended before the drain"
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        exited = time.monotonic() - signalled
        assert exited < 60
        print(f"decode SIGTERM: out of the registry in {left - signalled:.2f} s, exited 0 in {exited:.1f} s")
    finally:
        _stop(proc)


def test_a_decode_worker_started_again_at_its_address_serves_the_first_request_after(
    tiny_model, model_name, redis_url, registry, gateway, tmp_path
):
    """The only decode worker is killed and started again on the same port. Meanwhile the
    gateway's requests fail to connect (503: no decode worker), and a gRPC channel that fails to
    connect answers every call from its reconnect backoff (growing to seconds) with that error. The
    first request once the new worker serves must not get the old refusal (seen on hosts: a 503
    after a worker restarted on its host): the gateway dials the address anew and serves it."""
    port = str(free_port())
    body = _body(model_name, PROMPTS[2], 8, stream=False)
    first = _start_decode(tiny_model, redis_url, "again-a", 1.0, tmp_path / "first.log", "--port", port)
    second = None
    try:
        _poll(lambda: registry.get("again-a") or first.poll(), 120, "the decode worker to register")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        _poll(lambda: _answers(f"{gateway}/ready"), 30, "the gateway to see the worker")
        want = _complete(gateway, body)
        first.kill()
        first.wait(10)
        second = _start_decode(tiny_model, redis_url, "again-a", 1.0, tmp_path / "second.log", "--port", port)
        refused = 0
        deadline = time.monotonic() + 120
        while not serving(f"127.0.0.1:{port}", timeout_s=0.2):  # calls that keep the channel failing
            assert second.poll() is None and time.monotonic() < deadline, (
                tmp_path / "second.log"
            ).read_text()
            r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=30)
            refused += r.status_code == 503
            time.sleep(0.1)
        assert refused > 0, "no request fell in the worker's absence"
        r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        print(f"decode worker started again on its port: {refused} requests refused meanwhile, then served")
    finally:
        _stop(first)
        if second is not None:
            _stop(second)


# -- in-process workers: the drain deadline, the engine's death ----------------------------------
def test_drain_deadline_ends_what_is_left_with_unavailable(tiny_model, one_torch_thread):
    """Draining refuses new streams with UNAVAILABLE and NOT_SERVING; one still running at the
    deadline ends with UNAVAILABLE (for the gateway to resume elsewhere), not with a finish."""
    with _in_process(DecodeWorkerConfig(engine=_engine(tiny_model))) as (worker, loop):
        address = f"127.0.0.1:{worker.grpc_port}"
        with grpc.insecure_channel(address) as channel:
            stub = baton_pb2_grpc.DecodeStub(channel)
            call = _generate(stub, "long", PROMPTS[0], 3000)
            received = len(next(call).token_ids)
            started = time.monotonic()
            drained = asyncio.run_coroutine_threadsafe(worker.drain(2.0), loop)
            _poll(lambda: _health(address) == NOT_SERVING, 5, "NOT_SERVING")
            with pytest.raises(grpc.RpcError) as refused:
                list(_generate(stub, "late", PROMPTS[1], 4, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in refused.value.details()
            with pytest.raises(grpc.RpcError) as cut:
                for chunk in call:
                    received += len(chunk.token_ids)
                    assert not chunk.finish_reason, "the stream finished instead of being cut"
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain deadline" in cut.value.details()
            print(
                f"drain deadline 2.0 s: the open stream ended UNAVAILABLE {time.monotonic() - started:.2f} s in"
            )
            assert 0 < received < 3000
            assert drained.result(timeout=30) is False
            assert time.monotonic() - started < 2.0 + 5.0


def test_engine_death_takes_the_worker_out_of_service(
    tiny_model, redis_url, registry, one_torch_thread, monkeypatch
):
    """An engine step that raises kills the engine: the open stream ends with UNAVAILABLE, health
    goes NOT_SERVING, the registry key is deleted and the heartbeat stopped, and the worker asks
    to exit with EX_SOFTWARE (its injected exit function), which ``serve_worker`` - what ``baton
    decode`` runs - returns as the process's exit code, within ~2 s."""
    codes: list[int] = []
    made: list[DecodeWorker] = []
    config = DecodeWorkerConfig(
        engine=_engine(tiny_model), redis_url=redis_url, colocated=True, worker_id="fatal-d"
    )

    def make(on_exit):
        made.append(DecodeWorker(config, lambda code: (codes.append(code), on_exit(code))))
        return made[0]

    stop = asyncio.Event()
    with _event_loop() as loop, contextlib.ExitStack() as cleanup:
        served = asyncio.run_coroutine_threadsafe(serve_worker(make, stop), loop)
        cleanup.callback(lambda: served.done() or _drain_now(loop, stop, served))
        _poll(lambda: registry.get("fatal-d") or served.done(), 120, "the worker to register")
        assert not served.done(), served.result()
        worker = made[0]
        address = f"127.0.0.1:{worker.grpc_port}"
        with grpc.insecure_channel(address) as channel:
            watched: list[int] = []
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            watcher = threading.Thread(target=lambda: _collect(watch, watched), daemon=True)
            watcher.start()
            _poll(lambda: watched, 10, "the health watch to start")
            call = _generate(baton_pb2_grpc.DecodeStub(channel), "doomed", PROMPTS[2], 3000)
            next(call)

            def step(*args, **kwargs):
                raise RuntimeError("injected engine fault")

            monkeypatch.setattr(worker.engine.engine, "step", step)
            failed = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected engine fault" in e.value.details()
            assert served.result(timeout=5) == EX_SOFTWARE
            assert codes == [EX_SOFTWARE]
            assert time.monotonic() - failed < 3.0
            print(
                f"engine death: stream UNAVAILABLE, worker out and exit {EX_SOFTWARE} {time.monotonic() - failed:.2f} s after"
            )
            assert registry.get("fatal-d") is None
            assert not worker._heartbeat.running
            watcher.join(timeout=10)
            assert watched[0] == SERVING and NOT_SERVING in watched


def _drain_now(loop, stop: asyncio.Event, served) -> None:
    """Stop a worker that ``serve_worker`` still serves (a test that failed half-way)."""
    loop.call_soon_threadsafe(stop.set)
    served.result(timeout=60)


def _collect(watch, into: list[int]) -> None:
    with contextlib.suppress(grpc.RpcError):  # the stream ends when the server stops
        for response in watch:
            into.append(response.status)


# -- baton up: the gateway's drain, restarts, and stopping ---------------------------------------
@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """One colocated ``baton up`` of the tiny model: ``(base URL, supervisor metrics URL, proc)``."""
    logs = tmp_path_factory.mktemp("up-logs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        port, proc = start_up(
            ["--model", tiny_model, "--colocated", *ENGINE_FLAGS, "--drain-timeout", "30"], logs
        )
    line = next(s for s in proc.startup_lines if s.startswith("Supervisor metrics: "))
    yield f"http://127.0.0.1:{port}", line.split()[2], proc
    stop_up(proc)


def _restarts(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith('baton:service_restarts_total{service="'):
            name = line.split('"')[1]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _child(up_pid: int, role: str) -> int:
    """The pid of ``baton up``'s ``role`` service (``gateway``, ``decode``, ``redis-server``)."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            stat = (proc_dir / "stat").read_text()
            cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == up_pid and (
            role.encode() in cmd or role.encode() in cmd[0]  # Redis renames itself "redis-server host:port"
        ):
            return int(proc_dir.name)
    raise AssertionError(f"baton up has no {role} process")


def _children(up_pid: int) -> list[int]:
    out = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit():
            with contextlib.suppress(OSError):
                if int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1]) == up_pid:
                    out.append(int(proc_dir.name))
    return out


def _serves(base: str, model: str) -> bool:
    try:
        r = httpx.post(f"{base}/v1/completions", json=_body(model, PROMPTS[0], 2, False), timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def test_gateway_sigterm_finishes_its_open_stream(cluster, model_name):
    base, metrics, up = cluster
    body = _body(model_name, PROMPTS[1], 300, stream=True)
    want = _complete(base, body)
    first = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, base, body, first)
        assert first.wait(60), "the stream did not start"
        os.kill(_child(up.pid, "gateway"), signal.SIGTERM)
        signalled = time.monotonic()
        assert _tokens(stream.result(timeout=120)) == want
    finished = time.monotonic() - signalled
    _poll(lambda: _restarts(metrics).get("gateway") == 1, 60, "baton up to restart the gateway")
    _poll(lambda: _serves(base, model_name), 60, "the restarted gateway to serve")
    print(
        f"gateway SIGTERM: open stream finished {finished:.1f} s after, restarted and serving "
        f"{time.monotonic() - signalled:.1f} s after"
    )


def test_a_killed_decode_worker_is_restarted(cluster, model_name):
    base, metrics, up = cluster
    assert _restarts(metrics)["decode-0"] == 0
    killed_pid = _child(up.pid, "decode")
    os.kill(killed_pid, signal.SIGKILL)
    killed = time.monotonic()
    _poll(lambda: _restarts(metrics).get("decode-0") == 1, 30, "baton up to restart decode-0")
    _poll(lambda: _serves(base, model_name), 120, "the cluster to serve again", every_s=0.2)
    print(f"served again {time.monotonic() - killed:.1f} s after kill -9 of the decode worker")
    assert _child(up.pid, "decode") != killed_pid
    assert _restarts(metrics)["decode-0"] == 1


def test_a_killed_redis_is_restarted_on_its_port(cluster, model_name):
    """The embedded Redis comes back on its port, empty; the decode worker registers again at its
    next heartbeat and the cluster serves."""
    base, metrics, up = cluster
    os.kill(_child(up.pid, "redis-server"), signal.SIGKILL)
    killed = time.monotonic()
    _poll(lambda: _restarts(metrics).get("redis") == 1, 30, "baton up to restart Redis")
    _poll(lambda: _roles(base) == ["decode"], 30, "the decode worker to register again")
    print(
        f"Redis kill -9: restarted and the decode worker registered again {time.monotonic() - killed:.1f} s after"
    )
    assert _serves(base, model_name)


def _roles(base: str) -> list[str]:
    try:
        r = httpx.get(f"{base}/workers", timeout=5)
    except httpx.HTTPError:
        return []
    return [w["role"] for w in r.json()["workers"]] if r.status_code == 200 else []


def test_sigterm_on_up_drains_every_service(cluster, model_name):
    """SIGTERM on ``baton up`` with a stream open: it completes, every service exits and nothing is
    restarted meanwhile; the log names each earlier exit with its code."""
    base, _, up = cluster
    body = _body(model_name, PROMPTS[2], 300, stream=True)
    want = _complete(base, body)
    children = _children(up.pid)
    first = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, base, body, first)
        assert first.wait(60), "the stream did not start"
        up.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert _tokens(stream.result(timeout=120)) == want
    assert up.wait(timeout=60) == 0
    print(
        f"baton up SIGTERM: the open stream completed and every service exited in {time.monotonic() - signalled:.1f} s"
    )
    _poll(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10, "every service to exit")
    out = up.stdout.read()
    assert "gateway exited with code 0" in out, out
    assert "decode-0 exited with signal SIGKILL" in out, out
    assert "redis exited with signal SIGKILL" in out, out
    assert out.count("restarted (pid") == 3, out
