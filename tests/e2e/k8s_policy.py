"""Two of Kubernetes' admission and network rules written out, for tests/e2e/test_k8s.py to check
the rendered manifests against without a cluster: the Pod Security Standards' "restricted"
profile (which includes "baseline"), control by control as kubernetes.io's "Pod Security
Standards" page lists them, and NetworkPolicy's ingress semantics (who may open a connection to
which pod and port)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

# ---- Pod Security Standards: restricted -------------------------------------------------------

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
"""Baseline "Capabilities": what a container may add."""
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
"""Baseline "Sysctls": the safe set."""
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
"""Restricted "Volume Types": the only sources a volume may have."""


def _containers(spec: dict) -> Iterator[dict]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key, [])


def restricted_violations(template: dict) -> list[str]:
    """What keeps a pod template (``{metadata, spec}``) out of the restricted profile; [] passes."""
    spec, meta = template["spec"], template.get("metadata", {})
    pod_sc = spec.get("securityContext", {})
    out: list[str] = []
    bad = out.append
    # -- baseline
    for ns in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(ns):
            bad(f"host namespaces: {ns}")
    if pod_sc.get("windowsOptions", {}).get("hostProcess"):
        bad("HostProcess: pod")
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            bad(f"HostPath volumes: {v['name']}")
        sources = set(v) - {"name"}
        if not sources <= RESTRICTED_VOLUMES:
            bad(f"volume types: {v['name']} is {sorted(sources - RESTRICTED_VOLUMES)}")
    for s in pod_sc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            bad(f"sysctls: {s['name']}")
    for key, value in meta.get("annotations", {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            bad(f"AppArmor: {key}={value}")
    _check_context(pod_sc, "pod", bad)
    # -- restricted, at the pod level
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = pod_sc.get("seccompProfile", {}).get("type")
    for c in _containers(spec):
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            bad(f"privileged containers: {name}")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            bad(f"HostProcess: {name}")
        for p in c.get("ports", []):
            if p.get("hostPort", 0):
                bad(f"host ports: {name} {p['hostPort']}")
        _check_context(sc, name, bad)
        caps = sc.get("capabilities", {})
        added = set(caps.get("add", []))
        if not added <= BASELINE_CAPABILITIES:
            bad(f"capabilities: {name} adds {sorted(added - BASELINE_CAPABILITIES)}")
        if not added <= {"NET_BIND_SERVICE"}:
            bad(f"capabilities (restricted): {name} adds {sorted(added - {'NET_BIND_SERVICE'})}")
        if "ALL" not in caps.get("drop", []):
            bad(f"capabilities (restricted): {name} does not drop ALL")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad(f"privilege escalation: {name} does not set allowPrivilegeEscalation: false")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            bad(f"running as non-root: {name}")
        seccomp = sc.get("seccompProfile", {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad(f"seccomp (restricted): {name} has {seccomp}")
    return out


def _check_context(sc: dict, who: str, bad) -> None:
    """The controls a pod's and a container's securityContext share."""
    se = sc.get("seLinuxOptions", {})
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        bad(f"SELinux: {who} {se}")
    if sc.get("procMount", "Default") != "Default":
        bad(f"/proc mount type: {who}")
    if sc.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
        bad(f"AppArmor: {who}")
    if sc.get("seccompProfile", {}).get("type") == "Unconfined":
        bad(f"seccomp: {who} Unconfined")
    if sc.get("runAsUser") == 0:
        bad(f"running as non-root user: {who} runAsUser 0")


# ---- NetworkPolicy ingress --------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A pod that opens a connection (or receives one): its labels and its namespace's labels."""

    labels: dict = field(default_factory=dict)
    namespace: str = "baton"
    ports: dict = field(default_factory=dict)
    """containerPort name -> number, on a pod that receives."""

    @property
    def namespace_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (``matchLabels`` and ``matchExpressions``) against ``labels``; {} selects all."""
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(rule_peer: dict, source: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        return False  # pod traffic is matched by pod and namespace selectors here
    ns_sel, pod_sel = rule_peer.get("namespaceSelector"), rule_peer.get("podSelector")
    in_ns = (
        selects(ns_sel, source.namespace_labels)
        if ns_sel is not None
        else source.namespace == policy_namespace
    )
    return in_ns and (pod_sel is None or selects(pod_sel, source.labels))


def _port_matches(rule_ports: list[dict] | None, dest: Peer, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        want = p.get("port")
        number = dest.ports.get(want, want) if isinstance(want, str) else want
        if want is None or (number == port and p.get("protocol", "TCP") == "TCP"):
            return True
    return False


def may_connect(policies: list[dict], source: Peer, dest: Peer, port: int) -> bool:
    """Whether ``source`` may open a TCP connection to ``dest``'s ``port`` under these
    NetworkPolicies: open when none selects ``dest`` for ingress, else when a rule of one that does
    admits both the peer and the port."""
    applying = [
        p
        for p in policies
        if p["metadata"].get("namespace", "baton") == dest.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], dest.labels)
    ]
    if not applying:
        return True
    for policy in applying:
        ns = policy["metadata"].get("namespace", "baton")
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if (not peers or any(_peer_matches(pr, source, ns) for pr in peers)) and _port_matches(
                rule.get("ports"), dest, port
            ):
                return True
    return False
