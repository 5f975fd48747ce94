"""``baton up`` as a user runs it: a whole local cluster in real processes, driven by the official
``openai`` client, then stopped by SIGTERM with nothing left running. Its doors are locked (issue
28): Redis asks a password that no command line shows, and a worker record forged straight into
Redis by someone holding that password, but not the cluster secret, gets no request."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from baton.common.llm import SamplingParams
from baton.services.procs import parse_cpu_list
from tests.e2e.forged_worker import (
    cluster_redis,
    gateway_pid,
    recording_server,
    service_environ,
    service_flag,
    write_forgeries,
)
from tests.e2e.up_process import start_up, stop_up, worker_pids


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``: ``baton up``'s services and Redis, each in its own process
    group (so that a terminal's Ctrl-C reaches only ``baton up``)."""
    out = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit():
            try:
                stat = (proc_dir / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(proc_dir.name))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-logs")
    port, proc = start_up(["--dtype", "float32", "--kv-cache-gib", "1"], logs)
    # What the gateway answered the moment baton up said it was ready (its /ready is cached 1 s).
    proc.ready_at_start = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).json()  # type: ignore[attr-defined]
    yield port, proc
    stop_up(proc)


def test_chat_and_completion_through_the_cluster(cluster, llm_fp32):
    import openai

    port, _ = cluster
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    ref = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    streamed = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ref.outputs[0].text
    plain = client.completions.create(
        model=model, prompt="The three laws of robotics are", temperature=0, max_tokens=12
    )
    stream = client.completions.create(
        model=model, prompt="The three laws of robotics are", temperature=0, max_tokens=12, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    offline = llm_fp32.generate(
        ["The three laws of robotics are"], SamplingParams(temperature=0, max_tokens=12)
    )
    assert text == plain.choices[0].text == offline[0].outputs[0].text


def test_the_layout_it_chose_is_printed_and_is_what_runs(cluster):
    """With no layout flags ``baton up`` decides from the machine; the decision is printed, and
    every worker's ``/workers`` settings say what it runs: the dtype asked for, and torch threads
    as many as its cores."""
    import httpx

    port, proc = cluster
    layout = next(line for line in proc.startup_lines if line.startswith("Layout: "))
    assert "core" in layout and "W2-like request" not in layout  # --dtype given: no dtype was chosen
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    roles = sorted(w["role"] for w in workers)
    if "colocated" in layout:
        assert roles == ["decode"] and workers[0]["settings"]["colocated"] is True
    else:
        assert roles == ["decode", "prefill"] and "prefill worker" in layout
    for w in workers:
        s = w["settings"]
        assert s["dtype"] == "float32"
        assert s["threads"] == len(parse_cpu_list(s["cpus"])), s
        assert set(parse_cpu_list(s["cpus"])) <= os.sched_getaffinity(0)


def test_redis_asks_a_password_that_no_command_line_shows(cluster):
    import redis

    _, proc = cluster
    env = service_environ(gateway_pid(proc.pid))
    password, secret = env["BATON_REDIS_PASSWORD"], env["BATON_CLUSTER_SECRET"]
    assert len(password) >= 32 and len(secret) >= 32 and password != secret
    for pid in _children(proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline and secret.encode() not in cmdline, cmdline
    anonymous = cluster_redis(proc.pid, authenticated=False)
    with pytest.raises(redis.AuthenticationError):  # NOAUTH
        anonymous.get("baton:x")
    assert list(
        cluster_redis(proc.pid).scan_iter("baton:*")
    )  # the workers' records, written with the password


def test_each_service_is_its_roles_redis_user_and_the_gateway_only_reads(cluster):
    """Every service authenticates as its role's ACL user (``common/index/acl.py``), each with a
    password of its own; the gateway's user (the service that faces clients) reads the registry
    but cannot write it; no role may run an admin command or touch a key outside ``baton:*``."""
    import redis

    _, proc = cluster
    admin = _admin_redis(proc.pid)
    log = admin.execute_command("ACL", "LOG")
    assert log == [], [(e[b"username"], e[b"object"]) for e in log]  # the services' own work: nothing refused
    users = {}
    for name, pid in worker_pids(proc.pid).items():
        env = service_environ(pid)
        users[env["BATON_REDIS_USERNAME"]] = env["BATON_REDIS_PASSWORD"]
        assert env["BATON_REDIS_USERNAME"] == f"baton-{name.split('-')[0]}", name
    roles = {
        name.split("-")[0] for name in worker_pids(proc.pid)
    }  # prefill workers where the layout has them
    assert {"gateway", "decode"} <= roles and set(users) == {f"baton-{r}" for r in roles}
    assert len(set(users.values())) == len(users)
    gateway = cluster_redis(proc.pid, role="gateway")
    record = next(gateway.scan_iter("baton:*:worker:*"))
    assert gateway.get(record)  # it reads the registry
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.set(record, "{}")  # but cannot point a worker's record elsewhere
    for role in roles:
        client = cluster_redis(proc.pid, role=role)
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("GET", "other")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    assert len(admin.execute_command("ACL", "LOG")) >= 4  # and an operator sees who tried what


def _admin_redis(up_pid: int):
    """The embedded Redis as its default user, with the password of the config file in its working
    folder (readable by the user running ``baton up`` only): what an operator on the host can do."""
    import redis

    url = urlsplit(service_flag(gateway_pid(up_pid), "--redis-url"))
    for pid in _children(up_pid):
        if Path(f"/proc/{pid}/comm").read_text().startswith("redis-server"):
            conf = (Path(os.readlink(f"/proc/{pid}/cwd")) / "auth.conf").read_text()
            escaped = conf.split('requirepass "', 1)[1].split('"', 1)[0]
            password = bytes.fromhex(escaped.replace("\\x", "")).decode()
            return redis.Redis(host=url.hostname, port=url.port, password=password, socket_timeout=5)
    raise AssertionError("baton up has no redis-server child")


def test_ready_only_once_the_gateway_routes_to_every_prefill_worker(cluster):
    """``baton up`` waits on the gateway's ``/ready``, which counts the prefill workers in the
    router's own list (``--expect-prefill``): before, the gateway could be ready, and ``baton up``
    done waiting, while its router still had no prefill worker to name in the first requests."""
    port, proc = cluster
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    num_prefill = sum(w["role"] == "prefill" for w in workers)
    assert service_flag(gateway_pid(proc.pid), "--expect-prefill") == str(num_prefill)
    assert proc.ready_at_start["status"] == "ready"
    assert proc.ready_at_start["prefill_workers"] == num_prefill


def test_a_forged_worker_record_gets_no_request(cluster):
    """Someone who can write Redis, but lacks the cluster secret, registers workers at an address
    of theirs: the gateway does not list or route to them, the decode worker does not connect to
    them, requests complete, and their server receives nothing."""
    port, proc = cluster
    base = f"http://127.0.0.1:{port}"
    client = cluster_redis(proc.pid)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    with recording_server() as (address, calls):
        forged = write_forgeries(client, model, address)
        try:
            started = time.monotonic()
            for i in range(4):
                body = {"model": model, "prompt": [1000 + i] * 40, "max_tokens": 4, "temperature": 0}
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
            time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))  # past every registry refresh
            listed = {w["id"] for w in httpx.get(f"{base}/workers", timeout=10).json()["workers"]}
            assert not any(i.startswith("0-") for i in listed), listed
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            rejected = [
                x for x in metrics.splitlines() if x.startswith("baton:registry_rejected_records_total")
            ]
            assert rejected and float(rejected[0].rsplit(" ", 1)[1]) > 0, rejected
        finally:
            client.delete(*forged)
    assert calls == []


def test_sigterm_stops_everything(cluster):
    _, proc = cluster
    children = _children(proc.pid)
    assert len(children) >= 3, children  # Redis, a decode worker and the gateway at least
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30

    def alive() -> bool:
        return _group_alive(proc.pid) or any(Path(f"/proc/{pid}").exists() for pid in children)

    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), "a process of the cluster outlived baton up"
