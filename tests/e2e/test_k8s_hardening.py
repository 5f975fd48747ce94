"""k8s/'s locked doors and operators' details, read from the rendered manifests of every overlay
and variant (tests/e2e/k8s_render.py): Pod Security "restricted" for every pod, read-only root
filesystems, no Secret shipped, mutual TLS on the internal gRPC, who may reach what under the
NetworkPolicies, the decode pods' RBAC, pinned images, the ServiceMonitor's job names against the
Grafana dashboard's, Redis' bounds and budget, and the GPU overlay's GPUs, /dev/shm, NCCL and KV
cache as a fraction of the GPU's memory. The
rules themselves are written out in tests/e2e/k8s_policy.py; tests/e2e/test_k8s.py runs the pods."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.e2e.k8s_policy import Peer, may_connect, restricted_violations, selects
from tests.e2e.k8s_render import (
    K8S,
    OPERATOR_SECRETS,
    ROLES,
    ROOT,
    deploy_doc_section,
    find,
    pod_templates,
    render_all,
)
from tests.e2e.pod_certs import NAME as CERT_NAME

TLS_DIR = "/etc/baton/grpc-tls"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    return render_all(tmp_path_factory.mktemp("kustomize"))


def _template(docs: list[dict], role: str) -> dict:
    kind, name = ("StatefulSet", "redis") if role == "redis" else ("Deployment", f"baton-{role}")
    return find(docs, kind, name)["spec"]["template"]


def _container(docs: list[dict], role: str) -> dict:
    return _template(docs, role)["spec"]["containers"][0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ---- Pod Security "restricted" -----------------------------------------------------------------


def test_every_pod_of_every_overlay_passes_pod_security_restricted(rendered):
    for name, docs in rendered.items():
        ns = find(docs, "Namespace", "baton")["metadata"]["labels"]
        assert ns["pod-security.kubernetes.io/enforce"] == "restricted", name
        templates = pod_templates(docs)
        assert len(templates) == 4, (name, [t for t, _ in templates])  # 3 Deployments, Redis
        for workload, template in templates:
            assert restricted_violations(template) == [], f"{name}: {workload}"


BREAKAGES = {
    "host namespaces": lambda s, c: s.update(hostNetwork=True),
    "HostPath volumes": lambda s, c: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "volume types": lambda s, c: s["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}}),
    "privileged containers": lambda s, c: c["securityContext"].update(privileged=True),
    "does not drop ALL": lambda s, c: c["securityContext"]["capabilities"].pop("drop"),
    "adds ['SYS_ADMIN']": lambda s, c: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
    "allowPrivilegeEscalation": lambda s, c: c["securityContext"].pop("allowPrivilegeEscalation"),
    "running as non-root:": lambda s, c: s["securityContext"].pop("runAsNonRoot"),
    "runAsUser 0": lambda s, c: c["securityContext"].update(runAsUser=0),
    "seccomp (restricted)": lambda s, c: s["securityContext"].pop("seccompProfile"),
    "Unconfined": lambda s, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "host ports": lambda s, c: c["ports"][0].update(hostPort=50051),
    "sysctls": lambda s, c: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "SELinux": lambda s, c: c["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
    "/proc mount": lambda s, c: c["securityContext"].update(procMount="Unmasked"),
}


@pytest.mark.parametrize("control", sorted(BREAKAGES))
def test_the_restricted_check_refuses_each_control_broken(rendered, control):
    """The check above can fail: the decode pod with one control broken is refused for it."""
    template = copy.deepcopy(_template(rendered["cpu"], "decode"))
    BREAKAGES[control](template["spec"], template["spec"]["containers"][0])
    violations = restricted_violations(template)
    assert any(control in v for v in violations), violations


def test_containers_run_on_a_read_only_root_and_write_to_empty_dirs(rendered):
    """The image carries its kernel and weight caches under /opt/baton; what a process writes goes
    to an emptyDir (/tmp for Baton, /data for Redis)."""
    for name in ("cpu", "gpu"):
        docs = rendered[name]
        for role, scratch in [*((r, "/tmp") for r in ROLES), ("redis", "/data")]:
            template = _template(docs, role)
            container = template["spec"]["containers"][0]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, (name, role)
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            assert "emptyDir" in mounts[scratch], (name, role)
            for path in mounts:  # nothing under the image's own folders is shadowed
                assert not path.startswith(("/opt", "/home")), (name, role, path)


# ---- Secrets -----------------------------------------------------------------------------------


def _secret_refs(template: dict) -> set[tuple[str, str]]:
    """(Secret, key) of every env secretKeyRef and secret volume (each key it mounts) of a pod."""
    refs = set()
    for c in template["spec"]["containers"]:
        for e in c.get("env", []):
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                refs.add((ref["name"], ref["key"]))
    for v in template["spec"].get("volumes", []):
        if "secret" in v:
            name = v["secret"]["secretName"]
            items = v["secret"].get("items")
            refs |= (
                {(name, i["key"]) for i in items} if items else {(name, k) for k in OPERATOR_SECRETS[name]}
            )
    return refs


def test_no_manifest_ships_a_secret_and_the_operator_creates_each_one_named(rendered):
    for path in K8S.rglob("*.yaml"):
        assert "change-me" not in path.read_text(), path
    section = deploy_doc_section()
    for name, docs in rendered.items():
        assert not [d for d in docs if d["kind"] == "Secret"], name
        refs = set().union(*(_secret_refs(t) for _, t in pod_templates(docs)))
        assert refs == {(s, k) for s, keys in OPERATOR_SECRETS.items() for k in keys}, name
    for secret in OPERATOR_SECRETS:  # each with the line that makes it
        assert re.search(rf"kubectl -n baton create secret \w+ {secret}\b", section), secret


def test_every_baton_container_gets_its_roles_redis_user_and_the_cluster_secret(rendered):
    for name in ("cpu", "gpu"):
        docs = rendered[name]
        for role in ROLES:
            env = _env(_container(docs, role))
            assert env["BATON_REDIS_USERNAME"] == {"name": "BATON_REDIS_USERNAME", "value": f"baton-{role}"}
            assert env["BATON_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": "baton-redis",
                "key": f"{role}-password",
            }, role
            assert env["BATON_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {
                "name": "baton-cluster",
                "key": "secret",
            }, role
            # The password is never in REDIS_URL (ConfigMaps are not secret).
            config = find(docs, "ConfigMap", "baton-config")["data"]
            assert "@" not in config["REDIS_URL"]
        redis = _container(docs, "redis")
        args, env = redis["args"], _env(redis)
        # redis.conf from the Secret: the default user's password and the roles' ACL users.
        assert args[0] == "/etc/baton/redis/redis.conf" and "--requirepass" not in args
        assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "baton-redis", "key": "password"}
        volumes = find(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["volumes"]
        conf = next(v for v in volumes if "secret" in v)["secret"]
        assert conf["secretName"] == "baton-redis" and conf["items"] == [
            {"key": "redis.conf", "path": "redis.conf"}
        ]


# ---- internal gRPC on mutual TLS ---------------------------------------------------------------


def test_internal_grpc_is_mutual_tls_with_one_certificate_for_one_name(rendered):
    for name in ("cpu", "gpu"):
        docs = rendered[name]
        config = find(docs, "ConfigMap", "baton-config")["data"]
        # The name tests/e2e/pod_certs.py (and the docs' Certificate) put on the certificate.
        assert config["GRPC_TLS_SERVER_NAME"] == CERT_NAME
        for role in ROLES:
            template = _template(docs, role)
            container = template["spec"]["containers"][0]
            args = container["args"]
            assert _flag(args, "--grpc-tls-cert") == f"{TLS_DIR}/tls.crt", role
            assert _flag(args, "--grpc-tls-key") == f"{TLS_DIR}/tls.key", role
            assert _flag(args, "--grpc-tls-ca") == f"{TLS_DIR}/ca.crt", role  # the CA: mutual
            assert _flag(args, "--grpc-tls-server-name") == "$(GRPC_TLS_SERVER_NAME)", role
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR)
            volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == "baton-grpc-tls" and mount["readOnly"], role
            if role == "gateway":
                continue
            grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["python", "-m", "baton.services.health_probe"], (role, probe)
                assert _flag(command, "--port") == str(grpc_port) and _flag(command, "--tls-dir") == TLS_DIR


# ---- NetworkPolicies ---------------------------------------------------------------------------


def _peer(docs: list[dict], role: str) -> Peer:
    template = _template(docs, role)
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    return Peer(template["metadata"]["labels"], "baton", ports)


def test_who_may_reach_what(rendered):
    docs = rendered["cpu"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    gateway, prefill, decode, redis = (_peer(docs, r) for r in ("gateway", "prefill", "decode", "redis"))
    stranger = Peer({"app": "debug-shell"})
    # A pod elsewhere that copies Baton's labels: namespaces are part of the rule.
    impostor = Peer(dict(gateway.labels), namespace="other")
    prometheus = Peer({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    ingress = Peer({"app.kubernetes.io/name": "ingress-nginx"}, namespace="ingress-nginx")
    ucx = 41873  # UCX's KV listeners take ephemeral ports
    table = [
        # Redis: the three Baton roles, on 6379 only.
        (gateway, redis, 6379, True), (prefill, redis, 6379, True), (decode, redis, 6379, True),
        (stranger, redis, 6379, False), (impostor, redis, 6379, False), (prometheus, redis, 6379, False),
        (ingress, redis, 6379, False), (gateway, redis, 16379, False),
        # The gateway: its HTTP port from anywhere (clients through the ingress, Prometheus).
        (ingress, gateway, 8000, True), (stranger, gateway, 8000, True), (prometheus, gateway, 8000, True),
        (ingress, gateway, 9000, False),
        # The workers: gRPC from the gateway, anything between workers, metrics from monitoring.
        (gateway, decode, 50051, True), (gateway, decode, ucx, False), (decode, prefill, 50051, True),
        (decode, prefill, ucx, True), (prefill, decode, ucx, True), (prometheus, decode, 9100, True),
        (prometheus, prefill, 9100, True), (prometheus, decode, 50051, False), (stranger, decode, 50051, False),
        (impostor, decode, 50051, False), (ingress, prefill, 50051, False), (redis, decode, 50051, False),
    ]  # fmt: skip
    wrong = [
        (src.labels, src.namespace, dst.labels.get("app.kubernetes.io/component"), port, allowed)
        for src, dst, port, allowed in table
        if may_connect(policies, src, dst, port) != allowed
    ]
    assert not wrong, wrong
    # Every pod has a policy: with none, anyone may connect anywhere (the table's False rows flip).
    for peer in (gateway, prefill, decode, redis):
        assert [p for p in policies if selects(p["spec"]["podSelector"], peer.labels)], peer.labels
    assert may_connect([], stranger, redis, 6379)


# ---- RBAC --------------------------------------------------------------------------------------


def test_decode_pods_may_only_get_and_patch_pods_and_the_rest_hold_no_token(rendered):
    for name, docs in rendered.items():
        assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")], name
        role = find(docs, "Role", "baton-decode")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]
        binding = find(docs, "RoleBinding", "baton-decode")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "baton-decode",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "baton-decode", "namespace": "baton"}
        ]
        find(docs, "ServiceAccount", "baton-decode")
        for workload, template in pod_templates(docs):
            spec = template["spec"]
            if workload == "Deployment/baton-decode":
                assert spec["serviceAccountName"] == "baton-decode"
                env = _env(spec["containers"][0])
                assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
            else:
                assert spec["automountServiceAccountToken"] is False, (name, workload)


# ---- images ------------------------------------------------------------------------------------


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^\[project\][^\[]*?^version = "([^"]+)"', text, re.M | re.S).group(1)


def test_images_carry_the_version_and_are_pulled_only_if_not_present(rendered):
    for path in K8S.rglob("*"):
        if path.is_file():
            assert ":latest" not in path.read_text(), path
    version = _version()
    for name, docs in rendered.items():
        for workload, template in pod_templates(docs):
            for c in template["spec"]["containers"]:
                assert c["imagePullPolicy"] == "IfNotPresent", (name, workload)
                image, _, tag = c["image"].rpartition(":")
                assert image and tag and tag != "latest", (name, c["image"])
                if image == "baton":
                    assert tag == (f"{version}-cuda" if name == "gpu" else version), (name, c["image"])


# ---- the ServiceMonitor's jobs and the Grafana dashboard's -------------------------------------


def _job(service: dict, monitor: dict) -> str:
    """The job label the Prometheus Operator gives a Service's targets: the value of the Service's
    ``jobLabel`` label, else the Service's name."""
    return (
        service["metadata"]
        .get("labels", {})
        .get(monitor["spec"].get("jobLabel", ""), service["metadata"]["name"])
    )


def _dashboard_job_matchers() -> list[tuple[str, str]]:
    """(metric, job matcher as a regex) of every query of deploy/monitoring/grafana's dashboard."""
    text = (ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "baton.json").read_text()
    exprs: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(text))
    found = []
    for expr in exprs:
        for metric, op, value in re.findall(r'([a-z_:]+)\{[^}]*?job(=~?)"([^"]*)"', expr):
            found.append((metric, value if op == "=~" else re.escape(value)))
    return found


def _scraped_jobs(docs: list[dict]) -> dict[str, str]:
    """role -> job, for every Service the ServiceMonitor selects."""
    monitor = find(docs, "ServiceMonitor", "baton")
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    jobs = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        labels = svc["metadata"].get("labels", {})
        if selects(monitor["spec"]["selector"], labels) and ports & {p["name"] for p in svc["spec"]["ports"]}:
            jobs[labels["app.kubernetes.io/component"]] = _job(svc, monitor)
    return jobs


def test_the_dashboard_selects_the_jobs_the_servicemonitor_makes(rendered):
    docs = rendered["monitored"]
    jobs = _scraped_jobs(docs)
    assert set(jobs) == set(ROLES)
    matchers = _dashboard_job_matchers()
    assert len(matchers) > 10
    for metric, matcher in matchers:
        assert [j for j in jobs.values() if re.fullmatch(matcher, j)], (metric, matcher, jobs)
    selected = {j for _, m in matchers for j in jobs.values() if re.fullmatch(m, j)}
    assert selected == set(jobs.values())  # every pool has panels
    # And the check can fail: without jobLabel the jobs are the Services' names, which no panel selects.
    monitor = find(docs, "ServiceMonitor", "baton")
    bare = copy.deepcopy(monitor)
    bare["spec"].pop("jobLabel")
    names = {
        _job(s, bare) for s in docs if s["kind"] == "Service" and s["metadata"]["name"].startswith("baton-")
    }
    assert not [n for n in names for _, m in matchers if re.fullmatch(m, n)]


# ---- Redis -------------------------------------------------------------------------------------


def _bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([a-zA-Z]*)", size).groups()
    return int(number) * {"": 1, "mb": 2**20, "gb": 2**30, "Mi": 2**20, "Gi": 2**30}[unit]


def test_redis_is_bounded_under_its_limit_without_evicting_the_registry_and_budgeted(rendered):
    for name in ("cpu", "gpu"):
        docs = rendered[name]
        redis = _container(docs, "redis")
        maxmemory = _bytes(_flag(redis["args"], "--maxmemory"))
        assert maxmemory <= 0.6 * _bytes(redis["resources"]["limits"]["memory"]), name
        # Registry records carry TTLs: an LRU policy would evict live workers.
        assert _flag(redis["args"], "--maxmemory-policy") == "noeviction"
        pdb = find(docs, "PodDisruptionBudget", "redis")["spec"]
        labels = _template(docs, "redis")["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in pdb["selector"]["matchLabels"].items())
        assert pdb["maxUnavailable"] == 1  # one replica: a drain may still move it


# ---- CPU quota and the GPU overlay -------------------------------------------------------------


def test_each_worker_pods_cpu_limit_is_its_request(rendered):
    """The limit is the quota the worker sizes torch's threads by (services/cpu_quota.py)."""
    for name in ("cpu", "gpu"):
        for role in ("prefill", "decode"):
            resources = _container(rendered[name], role)["resources"]
            assert resources["limits"]["cpu"] == resources["requests"]["cpu"], (name, role)


def test_gpu_workers_take_a_gpu_per_rank_a_memory_shm_nccl_settings_and_a_memory_fraction(rendered):
    docs = rendered["gpu"]
    config = find(docs, "ConfigMap", "baton-config")["data"]
    assert config["GPU_MEMORY_UTILIZATION"] == "0.9"  # vLLM's default
    for role in ("prefill", "decode"):
        template = _template(docs, role)
        container = template["spec"]["containers"][0]
        # the KV cache is a fraction of the GPU's memory, not the base's size in GiB
        assert _flag(container["args"], "--gpu-memory-utilization") == "$(GPU_MEMORY_UTILIZATION)", role
        assert "--kv-cache-gib" not in container["args"], role
        assert _flag(_container(rendered["cpu"], role)["args"], "--kv-cache-gib") == "$(KV_CACHE_GIB)"
        ranks = int(config[f"{role.upper()}_TP"]) * int(config[f"{role.upper()}_PP"])
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(ranks)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", role
        assert template["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert config["NCCL_DEBUG"] == "WARN" and config["NCCL_SOCKET_IFNAME"]
    assert config["TRITON_CACHE_DIR"].startswith("/tmp/")  # the read-only root's one writable place
    for role in ("prefill", "decode"):  # and no GPU asked for on the cpu overlay
        assert "nvidia.com/gpu" not in json.dumps(_container(rendered["cpu"], role)["resources"])
