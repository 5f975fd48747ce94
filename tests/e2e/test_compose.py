"""compose.yaml and its monitoring profile, checked and run for real (no Docker needed).

The file validates against the Compose specification (the ``compose-spec`` parser, after YAML merge
keys and ``${VAR:-default}`` are resolved as Compose resolves them); Prometheus' config scrapes every
service at the ports their commands open; the Grafana dashboard's queries parse as PromQL. Then each
service's command and environment from compose.yaml is started as a local process (the image's
ENTRYPOINT ``baton`` is this interpreter's ``-m baton.cli``; the ``redis`` host is an
embedded Redis; every port a container opens gets a free local one; ``decode`` runs at its
``deploy.replicas``), each is waited on with its own healthcheck command, and a chat completion is
served with the KV moved by the prefill worker. Every metric the dashboard names must be in the live
services' /metrics.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import tomllib
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.common.index.server import EmbeddedRedis, EmbeddedRedisConfig
from baton.common.net import free_port

# Three workers with compose.yaml's own settings (a 4 GiB KV cache each): beside another module's
# cluster they would not fit in a 24 GiB machine, so `make test` runs this module alone.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "baton.json"
BATON_SERVICES = ("prefill", "decode", "gateway")
READY_TIMEOUT_S = 420.0  # three workers load SmolLM2 on a shared 2-core machine
SECRETS = "/run/baton"  # the `secrets` volume's mount point in every container
PROMETHEUS_LABELS = {"job", "instance"}  # added by the scrape, not by the services
_GRAFANA_MACRO = re.compile(r"\$__(rate_interval|interval|range)")
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}`` as Compose substitutes them."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def as_sent(expr: str) -> str:
    """A panel's query as Grafana sends it: its interval macros replaced by a duration."""
    return _GRAFANA_MACRO.sub("1m", expr)


def load_compose(env: dict[str, str] | None = None) -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env or {}))


# -- static checks -------------------------------------------------------------------------------
def test_compose_validates_against_the_spec():
    from compose_spec import PyCompose

    spec = PyCompose.from_json(json.dumps(load_compose()))
    spec.validate()
    assert {"redis", "gateway", "prefill", "decode"} <= set(spec.service_names())


def test_compose_needs_no_key_a_docker_engine_20_10_refuses():
    """Debian 12's engine (20.10) is the oldest supported: healthcheck ``start_interval`` needs 25."""

    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert "start_interval" not in set(keys(load_compose()))


def test_compose_runs_as_the_issue_asks():
    services = load_compose()["services"]
    assert services["redis"]["image"].startswith("redis:")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name in BATON_SERVICES:
        svc = services[name]
        assert svc["image"] == f"baton:{version}" and svc["build"] == "."
        assert svc["restart"] == "unless-stopped"
        assert svc["command"][0] == name
        assert svc["healthcheck"]["test"][0] == "CMD"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        # Locked doors: a read-only image, no capabilities, the secrets volume read-only, internal gRPC
        # on mutual TLS with the identity `secrets` made, Redis's password and the record key from files.
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in svc["security_opt"]
        assert "secrets:/run/baton:ro" in svc["volumes"]
        assert flag(svc["command"], "--grpc-tls-ca") == "/run/baton/ca.crt"
        assert flag(svc["command"], "--grpc-tls-server-name") == "baton-internal"
        # Each its role's Redis ACL user, with its own password (common/index/acl.py).
        assert svc["environment"]["BATON_REDIS_USERNAME"] == f"baton-{name}"
        assert svc["environment"]["BATON_REDIS_PASSWORD_FILE"] == f"/run/baton/redis-password-{name}"
        assert svc["environment"]["BATON_CLUSTER_SECRET_FILE"] == "/run/baton/cluster-secret"
        assert "backend" in svc["networks"]
        assert "--advertise-host" not in svc["command"]  # wildcard host: each replica its own IP
    for pool in ("prefill", "decode"):
        svc = services[pool]
        assert svc["deploy"]["replicas"] >= 1 and "ports" not in svc  # no fixed host port: --scale works
        assert flag(svc["command"], "--host") == "0.0.0.0"
        assert "UCX_TLS" in svc["environment"]
        drain = float(flag(svc["command"], "--drain-timeout"))
        assert seconds(svc["stop_grace_period"]) == drain + 10
    assert services["decode"]["deploy"]["replicas"] >= 2

    # Each pool's tensor- and pipeline-parallel degrees: 1 unless the shell says otherwise, and the
    # pools may differ.
    def degrees(svcs, name="--tensor-parallel-size"):
        return [flag(svcs[p]["command"], name) for p in ("prefill", "decode")]

    assert degrees(services) == ["1", "1"]
    assert degrees(load_compose({"DECODE_TP": "2"})["services"]) == ["1", "2"]
    assert degrees(services, "--pipeline-parallel-size") == ["1", "1"]
    assert degrees(load_compose({"PREFILL_PP": "2"})["services"], "--pipeline-parallel-size") == ["2", "1"]
    assert degrees(services, "--kv-cache-gib") == ["4", "4"]  # the engine's default
    assert degrees(services, "--dtype") == ["auto", "auto"]
    assert degrees(load_compose({"DTYPE": "float32"})["services"], "--dtype") == ["float32", "float32"]
    assert degrees(load_compose({"KV_CACHE_GIB": "8"})["services"], "--kv-cache-gib") == ["8", "8"]
    assert {"prefill", "decode"} <= set(services["gateway"]["depends_on"])
    assert services["secrets"]["command"] == ["secrets", "/run/baton"]
    assert services["redis"]["command"] == ["redis-server", "/run/baton/redis.conf"]
    assert services["redis"]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    # Only the gateway (and the monitoring UIs) publish, on loopback unless BATON_BIND says otherwise.
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    assert set(published) == {"gateway", "prometheus", "grafana"}
    assert all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports)
    assert load_compose({"BATON_BIND": "0.0.0.0"})["services"]["gateway"]["ports"] == ["0.0.0.0:8000:8000"]
    assert load_compose()["networks"]["backend"]["internal"] is True
    assert services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]


def test_prometheus_scrapes_every_service_at_its_metrics_port():
    services = load_compose()["services"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = {
        "gateway": ("gateway", flag(services["gateway"]["command"], "--port")),
        "prefill": ("prefill", flag(services["prefill"]["command"], "--metrics-port")),
        "decode": ("decode", flag(services["decode"]["command"], "--metrics-port")),
        "redis": ("redis-exporter", "9121"),
    }
    for job, (host, port) in expected.items():
        assert job in jobs, f"prometheus.yml scrapes no {job!r}"
        assert f"{host}:{port}" in scrape_targets(jobs[job]), (job, jobs[job])
    # A scaled pool is found by DNS (every replica's A record), not by a fixed list.
    for pool in ("prefill", "decode"):
        assert "dns_sd_configs" in jobs[pool]


def test_grafana_provisions_the_dashboard_and_its_queries_parse():
    import promql_parser

    provisioning = MONITORING / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "baton.yml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/etc/grafana/dashboards"
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    scraped = {job["job_name"] for job in config["scrape_configs"]}
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "itl", "goodput", "queue", "kv cache usage", "kv transfer", "prefix", "migrations"):
        assert topic in titles, f"no {topic!r} panel"
    assert "429" in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            query = promql_parser.parse(as_sent(target["expr"]))  # raises where Prometheus would
            jobs = job_matchers(query)
            assert jobs, f"{panel['title']!r}: {target['expr']} names no job"
            assert jobs <= scraped, f"{panel['title']!r}: no scrape job {jobs - scraped}"


# -- the cluster, from compose.yaml --------------------------------------------------------------
@dataclass
class Replica:
    """One container of a service, run as a local process."""

    service: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str]
    ports: dict[str, int]  # container port -> local port
    log: Path
    proc: subprocess.Popen | None = None

    def local(self, container_port: str | int) -> int:
        return self.ports[str(container_port)]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return float(match.group(1))


def scrape_targets(job: dict) -> set[str]:
    targets = {t for sc in job.get("static_configs", []) for t in sc["targets"]}
    for sd in job.get("dns_sd_configs", []):
        targets |= {f"{name}:{sd['port']}" for name in sd["names"]}
    return targets


def replica(service: str, svc: dict, redis_hostport: str, secrets: Path, logs: Path, index: int) -> Replica:
    """``svc``'s command with the ``redis`` host mapped to ``redis_hostport``, the secrets volume to
    ``secrets`` and each port it opens (``--port``, ``--metrics-port``) given a free local one; its
    healthcheck rewritten to match."""
    argv = [a.replace("redis:6379", redis_hostport).replace(SECRETS, str(secrets)) for a in svc["command"]]
    ports = {}
    for name in ("--port", "--metrics-port"):
        if name in argv:
            i = argv.index(name) + 1
            ports[argv[i]] = free_port()
            argv[i] = str(ports[argv[i]])
    check = list(svc["healthcheck"]["test"])
    assert check[0] == "CMD", "a CMD healthcheck runs without a shell"
    check = [sys.executable if a == "python" else a for a in check[1:]]
    for container, local in ports.items():
        check = [a.replace(f"127.0.0.1:{container}", f"127.0.0.1:{local}") for a in check]
    if "--port" in check:  # the health probe's own flag: the worker's gRPC port
        i = check.index("--port") + 1
        check[i] = str(ports[check[i]])
    check = [a.replace(SECRETS, str(secrets)) for a in check]
    # A variable without a value is passed through from the shell, as Compose does.
    given = {k: os.environ.get(k) if v is None else str(v) for k, v in (svc.get("environment") or {}).items()}
    env = {
        k: v.replace("redis:6379", redis_hostport).replace(SECRETS, str(secrets))
        for k, v in given.items()
        if v is not None
    }
    return Replica(service, argv, env, check, ports, logs / f"{service}-{index}.log")


def start(r: Replica) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"} | r.env
    with open(r.log, "wb") as log:
        r.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", *r.argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def healthy(r: Replica) -> bool:
    """Run the service's own healthcheck command once (its exit status, as Docker reads it)."""
    try:
        return subprocess.run(r.healthcheck, capture_output=True, timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def wait_healthy(replicas: list[Replica], timeout_s: float) -> None:
    pending = list(replicas)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            assert r.proc.poll() is None, f"{r.service} exited {r.proc.returncode}:\n{tail(r)}"
            if healthy(r):
                pending.remove(r)
        if pending:
            time.sleep(1.0)
    if pending:
        pytest.fail(
            f"not healthy after {timeout_s} s: {[r.service for r in pending]}\n"
            + "\n".join(tail(r) for r in pending)
        )


def stop(replicas: list[Replica]) -> None:
    """SIGTERM each (they drain), wait bounded, then make sure each process group is gone."""
    for r in replicas:
        if r.proc and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    for r in replicas:
        if r.proc is None:
            continue
        try:
            r.proc.wait(45)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(r.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tail(r: Replica) -> str:
    return f"--- {r.log.name}\n" + (r.log.read_text(errors="replace")[-3000:] if r.log.exists() else "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Three workers' KV caches on a 2-core, 24 GiB machine shared with the suite: 1 GiB each (4 by
    # default) spares them seconds of huge-page compaction at start.
    services = load_compose({"KV_CACHE_GIB": "1"})["services"]
    logs = tmp_path_factory.mktemp("compose")
    # The one-shot `secrets` service first (its command, its volume a local folder), then Redis as
    # its redis.conf says: the password, the roles' ACL users.
    secrets = tmp_path_factory.mktemp("secrets")
    argv = [a.replace(SECRETS, str(secrets)) for a in services["secrets"]["command"]]
    subprocess.run([sys.executable, "-m", "baton.cli", *argv], check=True, timeout=60)
    password = (secrets / "redis-password").read_text()
    redis = EmbeddedRedis(EmbeddedRedisConfig(password=password, config_file=str(secrets / "redis.conf")))
    url = redis.start()
    hostport = url.removeprefix("redis://").split("@")[-1].split("/")[0]
    workers = [
        replica(name, services[name], hostport, secrets, logs, i)
        for name in ("prefill", "decode")
        for i in range(services[name]["deploy"]["replicas"])
    ]
    gateway = replica("gateway", services["gateway"], hostport, secrets, logs, 0)
    everything = [*workers, gateway]
    try:
        began = time.monotonic()
        for r in workers:  # their depends_on is redis only: they start together
            start(r)
        wait_healthy(workers, READY_TIMEOUT_S)
        print(f"\nworkers healthy {time.monotonic() - began:.1f} s after start")
        start(gateway)  # depends_on every pool being healthy
        wait_healthy([gateway], 120.0)
        print(f"gateway healthy {time.monotonic() - began:.1f} s after the workers' start")
        yield {"workers": workers, "gateway": gateway}
    finally:
        stop(everything)
        redis.stop()


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """A live /metrics: sample name -> {sorted label items: value}."""
    return {name: series for name, (series, _) in scrape_families(port).items()}


def scrape_families(port: int) -> dict[str, tuple[dict[tuple, float], bool]]:
    """A live /metrics: sample name -> ({sorted label items: value}, whether the family has
    samples). A labelled family not yet observed (no migration so far) is served with its HELP and
    TYPE and no sample: its sample names are those of its type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, tuple[dict[tuple, float], bool]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, ({}, True))[0][tuple(sorted(s.labels.items()))] = s.value
        if not family.samples:
            for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)):
                out.setdefault(family.name + suffix, ({}, False))
    return out


_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def metrics_port(r: Replica) -> int:
    """The local port of ``r``'s /metrics: the gateway serves it on its HTTP port."""
    return int(flag(r.argv, "--port" if r.service == "gateway" else "--metrics-port"))


@pytest.mark.slow
def test_compose_cluster_serves_a_chat_completion_with_kv_from_the_prefill_worker(cluster):
    decodes = [r for r in cluster["workers"] if r.service == "decode"]
    assert len(decodes) == 2
    before = sum(total(scrape(metrics_port(d)), "baton:kv_transfer_bytes_total") for d in decodes)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster['gateway'].local(8000)}/v1", api_key="none", max_retries=0
    )
    prompt = "Describe, in a few sentences, why a container's healthcheck matters. " * 4  # > 32 tokens
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0.0,
        timeout=120,
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    moved = (reply.usage.model_extra or {}).get("kv_transfer_bytes", 0)
    assert moved > 0, reply.usage
    after = sum(total(scrape(metrics_port(d)), "baton:kv_transfer_bytes_total") for d in decodes)
    assert after - before == moved


def total(samples: dict[str, dict[tuple, float]], name: str) -> float:
    return sum(samples.get(name, {}).values())


@pytest.mark.slow
def test_every_metric_the_dashboard_names_is_served(cluster):
    import promql_parser

    live: dict[str, set[str] | None] = {}  # sample name -> label names seen on it (None: no sample yet)
    for r in [*cluster["workers"], cluster["gateway"]]:
        for name, (series, observed) in scrape_families(metrics_port(r)).items():
            if not observed:
                live.setdefault(name, None)
                continue
            labels = live.get(name) or set()
            for key in series:
                labels |= {k for k, _ in key}
            live[name] = labels
    dashboard = json.loads(DASHBOARD.read_text())
    named = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name, labels in selectors(promql_parser.parse(as_sent(target["expr"]))):
                named.add(name)
                assert name in live, f"{panel['title']!r} names {name}, which no service serves"
                seen = live[name]
                if seen is not None:  # an unobserved family's labels are unknown until it is
                    missing = labels - seen - PROMETHEUS_LABELS
                    assert not missing, f"{panel['title']!r}: {name} has no label {missing}"
    assert len(named) >= 10


def selectors(expr) -> list[tuple[str, set[str]]]:
    """Every vector selector in a parsed PromQL expression: its metric name and label names."""
    import promql_parser

    found = []
    if isinstance(expr, promql_parser.VectorSelector):
        labels = {m.name for m in expr.matchers.matchers if m.name != "__name__"}
        found.append((expr.name, labels))
    for child in _children(expr):
        found += selectors(child)
    if isinstance(expr, promql_parser.AggregateExpr) and expr.modifier is not None:
        # `sum by (reason) (...)`: what it groups by must be on the series it sums
        found = [(name, labels | set(expr.modifier.labels)) for name, labels in found]
    return found


def job_matchers(expr) -> set[str]:
    """The values a parsed query's ``job`` matchers accept (a regex alternation split apart)."""
    import promql_parser

    jobs = set()
    if isinstance(expr, promql_parser.VectorSelector):
        for m in expr.matchers.matchers:
            if m.name == "job":
                jobs |= set(m.value.split("|"))
    for child in _children(expr):
        jobs |= job_matchers(child)
    return jobs


def _children(expr) -> list:
    out = []
    for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
        child = getattr(expr, attr, None)
        if child is not None and not isinstance(child, (str, int, float)):
            out.append(child)
    out += [a for a in getattr(expr, "args", None) or [] if a is not None]
    return out


def registered(gateway: Replica) -> dict[str, int]:
    """Workers in the registry by role, as the gateway's /workers lists them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.local(8000)}/workers", timeout=10) as resp:
        workers = json.loads(resp.read())["workers"]
    roles: dict[str, int] = {}
    for w in workers:
        roles[w["role"]] = roles.get(w["role"], 0) + 1
    return roles


@pytest.mark.slow
def test_every_replica_registers_and_scaling_decode_down_drains_within_the_grace_period(cluster):
    """Last in the module: it stops a decode replica, as ``docker compose up --scale decode=1``
    does (SIGTERM, then SIGKILL after stop_grace_period), and the cluster keeps serving."""
    services = load_compose()["services"]
    gateway = cluster["gateway"]
    assert registered(gateway) == {"prefill": 1, "decode": 2}
    doomed = next(r for r in cluster["workers"] if r.service == "decode")
    grace = seconds(services["decode"]["stop_grace_period"])
    began = time.monotonic()
    doomed.proc.send_signal(signal.SIGTERM)
    code = doomed.proc.wait(grace)  # raises if Docker would have had to SIGKILL it
    print(f"decode replica drained and exited {code} in {time.monotonic() - began:.2f} s (grace {grace} s)")
    assert code == 0
    assert not healthy(doomed)
    deadline = time.monotonic() + 30
    while registered(gateway).get("decode") != 1:
        assert time.monotonic() < deadline, f"the stopped replica is still registered: {registered(gateway)}"
        time.sleep(0.2)
    print(f"out of the registry {time.monotonic() - began:.2f} s after SIGTERM")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{gateway.local(8000)}/v1", api_key="none", max_retries=0
    )
    for _ in range(3):  # each one reaches the remaining replica, none the stopped one
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=4,
            temperature=0.0,
            timeout=120,
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
