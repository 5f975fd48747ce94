"""k8s/ as CI can check it without a cluster: both overlays (and the KEDA variant) render with the
real ``kubectl kustomize``, every object validates against the Kubernetes schema, and the rendered
``k8s/overlays/cpu`` runs for real: its prefill, decode and gateway Deployments' args and env
(ConfigMap, Secret and downward API resolved) start as local processes, their own startup,
readiness and liveness probes are executed against them, a chat completion crosses them with the
KV moved by the prefill worker, every metric an autoscaler names is in their live ``/metrics``, and
each exits within its terminationGracePeriodSeconds on SIGTERM."""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from baton.common.index.server import EmbeddedRedis, free_port
from baton.services.procs import baton_command
from tests.procs import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
"""Custom resources: no schema ships with kubernetes-validate, so they are skipped by name."""
ROLES = ("prefill", "decode", "gateway")
POD_IP = "127.0.0.1"
# Serial: beside another module's cluster on the same two cores, the one chat completion of
# test_a_chat_completion_crosses_the_rendered_deployments was once prefilled on its decode worker
# (a fault costs latency: the decode pool computes a prompt it cannot hand off), so no KV crossed.
pytestmark = pytest.mark.serial

TEST_CONFIG = {"DTYPE": "float32", "KV_CACHE_GIB": "0.3", "MAX_MODEL_LEN": "2048", "DRAIN_TIMEOUT": "0.2"}
"""What the test's own overlay changes, as an operator's would: a small KV cache for this machine,
and a drain so short that an open stream outlives it and has to move, however fast the machine."""


def _kubectl() -> str:
    path = Path(sys.executable).with_name("kubectl")
    return str(path) if path.exists() else shutil.which("kubectl") or "kubectl"


def _render(kustomization_dir: Path) -> list[dict]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(kustomization_dir)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _rel(path: Path, start: Path) -> str:
    """kustomize takes no absolute resource paths: ``path`` seen from ``start``."""
    return os.path.relpath(path, start)


def _write_kustomization(path: Path, body: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    body = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **body}
    (path / "kustomization.yaml").write_text(yaml.safe_dump(body))
    return path


def _keda_variant(tmp: Path) -> Path:
    """The base with the KEDA component in place of the HPAs, as docs/deploy.md tells."""
    here = tmp / "keda"
    return _write_kustomization(
        here,
        {
            "namespace": "baton",
            "resources": [_rel(K8S / "base", here)],
            "components": [_rel(K8S / "components" / "keda", here)],
        },
    )


def _find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {
        "cpu": _render(K8S / "overlays" / "cpu"),
        "gpu": _render(K8S / "overlays" / "gpu"),
        "keda": _render(_keda_variant(tmp)),
    }


# ---- rendering and schema ----------------------------------------------------------------------


def test_both_overlays_render_pools_scaled_apart(rendered):
    for name, docs in rendered.items():
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"baton"}
        if name == "keda":
            continue
        for role in ROLES:
            _find(docs, "Deployment", f"baton-{role}")
        _find(docs, "StatefulSet", "redis")
        _find(docs, "Service", "redis")
        _find(docs, "Service", "baton-gateway")
        _find(docs, "ServiceMonitor", "baton")
        _find(docs, "NetworkPolicy", "baton-workers")
        for role in ("prefill", "decode"):
            hpa = _find(docs, "HorizontalPodAutoscaler", f"baton-{role}")
            assert hpa["spec"]["scaleTargetRef"]["name"] == f"baton-{role}", name
            _find(docs, "PodDisruptionBudget", f"baton-{role}")
    gpu_decode = _find(rendered["gpu"], "Deployment", "baton-decode")["spec"]["template"]["spec"]
    assert gpu_decode["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu_decode["containers"][0]["image"] == "baton:cuda"
    args = gpu_decode["containers"][0]["args"]  # the engine runs on the pod's GPU, not its CPU
    assert args[args.index("--device") + 1] == "$(DEVICE)"
    assert _find(rendered["gpu"], "ConfigMap", "baton-config")["data"]["DEVICE"] == "cuda"
    assert _find(rendered["cpu"], "ConfigMap", "baton-config")["data"]["DEVICE"] == "cpu"
    keda = rendered["keda"]
    assert not [d for d in keda if d["kind"] == "HorizontalPodAutoscaler"]
    for role in ("prefill", "decode"):
        assert (
            _find(keda, "ScaledObject", f"baton-{role}")["spec"]["scaleTargetRef"]["name"] == f"baton-{role}"
        )


def test_each_worker_pod_runs_its_pools_parallel_degrees(rendered):
    """One pod per worker, its ranks processes inside it: the tensor- and pipeline-parallel degrees
    are per-pool settings, so a prefill pool and a decode pool may differ (the KV is re-sharded in
    transfer)."""
    for name in ("cpu", "gpu"):
        config = _find(rendered[name], "ConfigMap", "baton-config")["data"]
        for role in ("prefill", "decode"):
            spec = _find(rendered[name], "Deployment", f"baton-{role}")["spec"]["template"]["spec"]
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

    good = _find(rendered["cpu"], "Deployment", "baton-decode")
    _validate(good)
    for breakage in ("typo", "port"):
        bad = copy.deepcopy(good)
        container = bad["spec"]["template"]["spec"]["containers"][0]
        if breakage == "typo":
            container["readinessProbe"]["grpcc"] = container["readinessProbe"].pop("grpc")
        else:
            container["ports"][0]["containerPort"] = "fifty"
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(bad)


def test_pods_take_their_address_and_key_from_the_cluster_and_drain_within_grace(rendered):
    docs = rendered["cpu"]
    config = _find(docs, "ConfigMap", "baton-config")["data"]
    drain = int(config["DRAIN_TIMEOUT"])
    for role in ROLES:
        spec = _find(docs, "Deployment", f"baton-{role}")["spec"]["template"]["spec"]
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
            assert set(container[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, role
    assert config["UCX_TLS"] == "tcp,self"


def test_only_baton_pods_reach_the_workers(rendered):
    policy = _find(rendered["cpu"], "NetworkPolicy", "baton-workers")["spec"]
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
    """One Deployment's container run as a local process."""

    role: str
    name: str
    """The pod's name, ``baton-<role>-<n>`` (what the downward API gives as metadata.name)."""
    container: dict
    ports: dict[str, int]
    """containerPort name and number (as text) -> the local port that stands for it."""
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


def _secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return data | secret.get("stringData", {})


def _resolve_env(container: dict, docs: list[dict], pod_name: str, services: dict[str, str]) -> dict:
    """The container's environment as the kubelet builds it, with service DNS names mapped."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= _find(docs, "ConfigMap", source["configMapRef"]["name"])["data"]
    fields = {"status.podIP": POD_IP, "metadata.name": pod_name, "metadata.namespace": "baton"}
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif "fieldRef" in ref:
            env[item["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in ref:
            key = ref["configMapKeyRef"]
            env[item["name"]] = _find(docs, "ConfigMap", key["name"])["data"][key["key"]]
        else:
            key = ref["secretKeyRef"]
            env[item["name"]] = _secret_data(_find(docs, "Secret", key["name"]))[key["key"]]
    return {k: _map_services(v, services) for k, v in env.items()}


def _map_services(value: str, services: dict[str, str]) -> str:
    """``redis:6379`` (or ``redis.baton.svc.cluster.local:6379``) -> the local address for it."""
    for host_port, local in services.items():
        host, port = host_port.rsplit(":", 1)
        value = re.sub(rf"\b{re.escape(host)}(\.baton(\.svc(\.cluster\.local)?)?)?:{port}\b", local, value)
    return value


def _start_pod(docs: list[dict], role: str, index: int, services: dict[str, str], logs: Path) -> Pod:
    spec = _find(docs, "Deployment", f"baton-{role}")["spec"]["template"]["spec"]
    name = f"baton-{role}-{index}"
    container = spec["containers"][0]
    assert "command" not in container, "the image's ENTRYPOINT (baton) is the command"
    ports: dict[str, int] = {}
    for p in container["ports"]:
        ports[p["name"]] = ports[str(p["containerPort"])] = free_port()
    env = _resolve_env(container, docs, name, services)
    args = [_expand(a, env) for a in container["args"]]
    # A container port is this process's own free port: swap the number after the flags that bind.
    for i, a in enumerate(args[:-1]):
        if a in ("--port", "--metrics-port"):
            args[i + 1] = str(ports[args[i + 1]])
    log = logs / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*baton_command(), *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    return Pod(role, name, container, ports, proc, log, spec["terminationGracePeriodSeconds"])


def _probe_once(pod: Pod, probe: dict) -> bool:
    timeout = probe.get("timeoutSeconds", 1) + 2  # a little slack on a busy 2-core machine
    if "grpc" in probe:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        target = f"127.0.0.1:{pod.local_port(probe['grpc']['port'])}"
        with grpc.insecure_channel(target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout
                )
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
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
        time.sleep(min(period, 0.5))  # faster than the kubelet: readiness is what is waited for
    return time.monotonic() - start


def _stop(pod: Pod) -> None:
    if pod.proc.poll() is None:
        os.killpg(pod.proc.pid, signal.SIGKILL)
    pod.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cpu overlay, under the test's own overlay (TEST_CONFIG), run as local processes."""
    tmp = tmp_path_factory.mktemp("k8s-run")
    here = tmp / "overlay"
    overlay = _write_kustomization(
        here,
        {
            "resources": [_rel(K8S / "overlays" / "cpu", here)],
            "configMapGenerator": [
                {
                    "name": "baton-config",
                    "behavior": "merge",
                    "literals": [f"{k}={v}" for k, v in TEST_CONFIG.items()],
                    "options": {"disableNameSuffixHash": True},
                }
            ],
        },
    )
    docs = _render(overlay)
    redis = EmbeddedRedis()
    redis_url = redis.start()
    services = {"redis:6379": redis_url.split("//", 1)[1].split("/", 1)[0]}
    pods: dict[str, Pod] = {}
    try:
        for role in ROLES:
            # One pod a Deployment, but the decode pool's replicas (2): a draining decode pod's
            # streams move to the other.
            replicas = _find(docs, "Deployment", f"baton-{role}")["spec"].get("replicas", 1)
            for i in range(replicas if role == "decode" else 1):
                pod = _start_pod(docs, role, i, services, tmp)
                pods[pod.name] = pod
        for pod in pods.values():
            _run_probe(pod, "startupProbe")
        for pod in pods.values():
            _run_probe(pod, "readinessProbe", limit_s=120)
        yield docs, pods
    finally:
        for pod in pods.values():
            _stop(pod)
        redis.stop()


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

    key = key or _secret_data(_find(docs, "Secret", "baton-api-key"))["BATON_API_KEY"]
    base = f"http://127.0.0.1:{_of(pods, 'gateway')[0].local_port('http')}/v1"
    return openai.OpenAI(base_url=base, api_key=key, timeout=120, max_retries=0)


def _kv_bytes_received(pods: dict[str, Pod]) -> float:
    return sum(_sample(_metrics(p), "baton:kv_transfer_bytes_total") for p in _of(pods, "decode"))


# Longer than REMOTE_PREFILL_THRESHOLD (32) uncached tokens: the prefill pool computes it.
PROMPT = "In three short sentences, explain why the sky looks blue on a clear day at noon. " * 2


@pytest.mark.slow
def test_a_chat_completion_crosses_the_rendered_deployments(cluster):
    import openai

    docs, pods = cluster
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
    assert _kv_bytes_received(pods) > before, "no decode worker received KV from the prefill worker"
    with pytest.raises(openai.AuthenticationError):
        _client(docs, pods, key="wrong").models.list()
    for pod in pods.values():
        assert _run_probe(pod, "livenessProbe") < 5, pod.name


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
    _, pods = cluster
    live: dict[str, set[str]] = {}
    for pod in pods.values():
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


MIGRATED_TOKENS = 24
"""Enough to outlast the 0.2 s drain after the first token; few, since a loaded 2-core machine
decodes SmolLM2 at as little as ~1.5 tokens a second."""


@pytest.mark.slow
def test_a_rolling_update_moves_a_stream_off_the_draining_decode_pod(cluster):
    """A rollout SIGTERMs a decode pod with a stream open: the stream outlives its drain
    (DRAIN_TIMEOUT 0.2 s here), is resumed on the other decode pod, and the client gets every token."""
    docs, pods = cluster
    gateway = _of(pods, "gateway")[0]
    before = _sum(_metrics(gateway), "baton:request_migrations_total")
    client = _client(docs, pods)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=MIGRATED_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    drained, usage, pieces, stamps = None, None, 0, []
    for chunk in stream:
        stamps.append(time.monotonic())
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
            if drained is None:
                drained = _busy_decode_pod(pods)
                os.killpg(drained.proc.pid, signal.SIGTERM)
    assert drained is not None and usage is not None
    assert usage.completion_tokens == MIGRATED_TOKENS
    assert drained.proc.wait(timeout=drained.grace_s) == 0, drained.tail()
    assert _sum(_metrics(gateway), "baton:request_migrations_total") > before, "the stream did not move"
    gap = max(b - a for a, b in zip(stamps, stamps[1:]))
    print(
        f"[k8s] {drained.name} drained with a stream open; the client got all {MIGRATED_TOKENS} "
        f"tokens, the longest pause between chunks {gap:.2f} s"
    )


@pytest.mark.slow
def test_each_pod_exits_within_its_grace_period_on_sigterm(cluster):
    """What the kubelet does when a rollout or scale-down deletes the pods: SIGTERM to each, then
    SIGKILL once terminationGracePeriodSeconds have passed; each must have exited (0) by then."""
    _, pods = cluster
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
