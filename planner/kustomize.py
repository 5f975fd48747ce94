"""A plan as a kustomize overlay on ``k8s/`` (pure: the overlay is a dict; ``baton plan
--kustomize DIR`` writes it as ``DIR/kustomization.yaml``).

What it sets, on whichever autoscaler the base has (``k8s/components/hpa`` or ``keda``; a patch
whose target is absent is skipped by kustomize):

- each pool's Deployment replicas: the plan's counts;
- each pool's autoscaler: at least the plan's count (the rate it was planned for is the floor), at
  most what the budget leaves beside the other pool's planned count;
- the chunk it chose: ``--max-num-batched-tokens`` appended to both pools' worker args (the
  last of a flag wins);
- the targets: the prompt tokens queued per prefill pod that the pod clears in half the TTFT SLO
  (its profiled prefill rate x TTFT / 2), the running sequences per decode pod at which its step
  still meets the TPOT SLO (the plan's closed-form decode batch), and KEDA's latency triggers at
  the SLOs themselves.

Colocated: the decode pool is the workers, prefilling every prompt itself
(``REMOTE_PREFILL_THRESHOLD`` past any prompt), the prefill Deployment at 0 replicas and its
autoscaler deleted (an HPA cannot scale to 0).
"""

from __future__ import annotations

import json
import math

from baton.planner.layout import Layout
from baton.planner.sim_result import SLO

NEVER_REMOTE = 1 << 30
"""A remote-prefill threshold no prompt reaches: the decode workers prefill everything."""


def overlay(
    layout: Layout,
    base: str,
    max_workers: int,
    slo: SLO,
    prefill_tok_s: float,
    decode_batch: int,
    chunk: int | None = None,
) -> dict:
    """The overlay's kustomization for ``layout`` on ``base`` (a path relative to the overlay),
    with ``chunk`` as the workers' ``--max-num-batched-tokens`` (None: the base's)."""
    body: dict = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "baton",
        "resources": [base],
        "replicas": [
            {"name": "baton-prefill", "count": layout.prefill},
            {"name": "baton-decode", "count": layout.decode},
        ],
        "patches": _decode_patches(layout, max_workers, slo, decode_batch),
    }
    if layout.colocated:
        body["patches"] += [_delete(kind, "baton-prefill") for kind in _AUTOSCALERS]
        body["configMapGenerator"] = [
            {
                "name": "baton-config",
                "behavior": "merge",
                "literals": [f"REMOTE_PREFILL_THRESHOLD={NEVER_REMOTE}"],
                "options": {"disableNameSuffixHash": True},
            }
        ]
    else:
        body["patches"] += _prefill_patches(layout, max_workers, slo, prefill_tok_s)
    if chunk is not None:
        add = "/spec/template/spec/containers/0/args/-"
        ops = [{"op": "add", "path": add, "value": v} for v in ("--max-num-batched-tokens", str(chunk))]
        target = {"kind": "Deployment", "name": "baton-(prefill|decode)"}
        body["patches"].append({"target": target, "patch": json.dumps(ops)})
    return body


_AUTOSCALERS = {
    "HorizontalPodAutoscaler": ("autoscaling/v2", "minReplicas", "maxReplicas"),
    "ScaledObject": ("keda.sh/v1alpha1", "minReplicaCount", "maxReplicaCount"),
}


def _bounds(count: int, other: int, max_workers: int) -> tuple[int, int]:
    return count, max(count, max_workers - other)


def _prefill_patches(layout: Layout, max_workers: int, slo: SLO, prefill_tok_s: float) -> list[dict]:
    lo, hi = _bounds(layout.prefill, layout.decode, max_workers)
    hpa: list[dict] = []
    keda: list[dict] = []
    if math.isfinite(slo.ttft_ms) and math.isfinite(prefill_tok_s):
        queued = str(max(1, round(prefill_tok_s * slo.ttft_ms / 1000.0 / 2)))
        hpa.append(_replace("/spec/metrics/0/pods/target/averageValue", queued))
        keda.append(_replace("/spec/triggers/0/metadata/threshold", queued))
        keda.append(_replace("/spec/triggers/1/metadata/threshold", _seconds(slo.ttft_ms)))
    return _scaler_patches("baton-prefill", lo, hi, hpa, keda)


def _decode_patches(layout: Layout, max_workers: int, slo: SLO, decode_batch: int) -> list[dict]:
    lo, hi = _bounds(layout.decode, layout.prefill, max_workers)
    running = str(max(1, decode_batch))
    hpa = [_replace("/spec/metrics/0/pods/target/averageValue", running)]
    keda = [_replace("/spec/triggers/0/metadata/threshold", running)]
    if math.isfinite(slo.tpot_ms):
        keda.append(_replace("/spec/triggers/2/metadata/threshold", _seconds(slo.tpot_ms)))
    return _scaler_patches("baton-decode", lo, hi, hpa, keda)


def _scaler_patches(name: str, lo: int, hi: int, hpa: list[dict], keda: list[dict]) -> list[dict]:
    out = []
    for kind, ops in (("HorizontalPodAutoscaler", hpa), ("ScaledObject", keda)):
        _, min_key, max_key = _AUTOSCALERS[kind]
        ops = [_replace(f"/spec/{min_key}", lo), _replace(f"/spec/{max_key}", hi), *ops]
        out.append({"target": {"kind": kind, "name": name}, "patch": json.dumps(ops)})
    return out


def _replace(path: str, value) -> dict:
    return {"op": "replace", "path": path, "value": value}


def _delete(kind: str, name: str) -> dict:
    api = _AUTOSCALERS[kind][0]
    patch = f"$patch: delete\napiVersion: {api}\nkind: {kind}\nmetadata:\n  name: {name}\n"
    return {"target": {"kind": kind, "name": name}, "patch": patch}


def _seconds(ms: float) -> str:
    return f"{ms / 1000.0:g}"
