"""k8s/components/autoscaler rendered as ``kubectl apply -k`` would send it (the real ``kubectl
kustomize``): the autoscaler's Deployment runs ``baton autoscaler`` with arguments the real CLI
accepts, whose bounds are the ScaledObjects' own, and each pool's ScaledObject follows the series
the service exports; every built-in kind validates against the Kubernetes schema."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from baton.cli.main import build_parser
from baton.planner.autoscale import Autoscaler
from baton.planner.sim_result import SLO
from baton.services.autoscaler import AutoscalerService, autoscale_config
from tests.e2e.k8s_render import K8S, find, rel, render, write_kustomization
from tests.unit.test_autoscale import decode_heavy_profile

CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict]:
    here = tmp_path_factory.mktemp("kustomize") / "autoscaled"
    body = {
        "namespace": "baton",
        "resources": [rel(K8S / "base", here)],
        "components": [rel(K8S / "components" / "autoscaler", here)],
    }
    return render(write_kustomization(here, body))


def _args(docs: list[dict]) -> list[str]:
    """The container's arguments with ``$(VAR)`` expanded from its ConfigMap, as the kubelet does."""
    pod = find(docs, "Deployment", "baton-autoscaler")["spec"]["template"]["spec"]
    env = find(docs, "ConfigMap", "baton-autoscaler")["data"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in pod["containers"][0]["args"]]


def test_the_deployment_runs_the_real_command_with_the_scaledobjects_bounds(docs):
    a = build_parser().parse_args(_args(docs))
    assert a.func.__name__ == "run_autoscaler" and a.gateway_url == "http://baton-gateway"
    cfg = autoscale_config(a)
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    for pool in ("prefill", "decode"):
        so = find(docs, "ScaledObject", f"baton-{pool}")["spec"]
        assert so["scaleTargetRef"]["name"] == f"baton-{pool}"
        find(docs, "Deployment", f"baton-{pool}")
        assert (so["minReplicaCount"], so["maxReplicaCount"]) == cfg.bounds_of(pool)
        (trigger,) = so["triggers"]
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
        assert f'pool="{pool}"' in trigger["metadata"]["query"]


def test_the_scaledobjects_query_the_series_the_service_exports(docs):
    service = AutoscalerService(Autoscaler(decode_heavy_profile(), SLO(500, 50), False), "http://g", str)
    service.desired.labels(pool="decode").set(3)
    exported = generate_latest(service.registry).decode()
    for pool in ("prefill", "decode"):
        query = find(docs, "ScaledObject", f"baton-{pool}")["spec"]["triggers"][0]["metadata"]["query"]
        name = re.search(r"\(([\w:]+)\{", query).group(1)
        assert f"\n{name}{{" in exported, (name, exported)
        assert 'service="baton-autoscaler"' in query
    port = find(docs, "Service", "baton-autoscaler")["spec"]["ports"][0]
    assert str(port["port"]) == _args(docs)[_args(docs).index("--port") + 1]


def test_every_built_in_kind_validates(docs):
    import kubernetes_validate

    skipped = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRDS:
            skipped.add(key)
            continue
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert skipped == CRDS
