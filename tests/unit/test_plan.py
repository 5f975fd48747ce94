"""``baton plan`` (planner/plan.py, plan_cli.py, kustomize.py): decisions on fixed workloads with a
synthetic profile whose answers can be reasoned about, the choice's minimality checked by simulating
every layout of one worker fewer, the unmet case, the closed-form baseline's arithmetic, the JSON
and report of the command, and its kustomize overlay rendered by the real kubectl and validated
against the Kubernetes schema."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from baton.planner.baseline import prefill_ms_per_prompt
from baton.planner.kustomize import NEVER_REMOTE, overlay
from baton.planner.layout import Layout, parse_layout
from baton.planner.plan import Budget, Search, at_rate, baseline, chunk_choices, plan
from baton.planner.profile import Linear, Machine, Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import simulate
from baton.planner.workload import Workload, parse_lengths
from tests.planner_profiles import synthetic_profile

ROOT = Path(__file__).resolve().parents[2]
SLO_ = SLO(ttft_ms=1000.0, tpot_ms=30.0)


def _profile(**engine) -> Profile:
    """A prompt of 1000 tokens costs 105 ms to prefill (about 10 a second a worker), a decode step
    10 + 0.5 x batch ms: a batch of 40 is the most a step carries within a 30 ms TPOT (32 here:
    max_num_seqs)."""
    return synthetic_profile(
        Linear(5.0, 0.1, 0.0), Linear(10.0, 0.5, 0.0), cores=2, **{"max_num_seqs": 32, **engine}
    )


def _workload(rate: float, inp: str, out: str, n: int = 400) -> Workload:
    return Workload(rate=rate, num_prompts=n, input_len=parse_lengths(inp), output_len=parse_lengths(out))


PREFILL_HEAVY = _workload(12.0, "1000", "16")
DECODE_HEAVY = _workload(12.0, "64", "256")


def _fewer_layouts(workers: int) -> list[Layout]:
    n = workers - 1
    return [Layout(0, n, True)] + [Layout(p, n - p, False) for p in range(1, n)] if n >= 1 else []


@pytest.mark.parametrize(
    ("workload", "expected"),
    [(PREFILL_HEAVY, "2p1d"), (DECODE_HEAVY, "colocated:3")],
    ids=["prefill", "decode"],
)
def test_the_choice_is_the_fewest_workers_meeting_the_rate(workload, expected):
    profile = _profile()
    p = plan(profile, workload, SLO_, Budget(max_workers=8))
    assert p.met and str(p.chosen.layout) == expected
    assert p.chosen.attainment >= 0.9
    # Minimal: no layout of one worker fewer meets it (simulated here, not taken from the search).
    for layout in _fewer_layouts(p.chosen.workers):
        r = simulate(profile, layout, workload, SLO_, seed=0)
        assert r.slo_attainment < 0.9, layout
    # Its neighbours with one worker fewer are listed first, each with the SLO it misses.
    first = p.runners_up[0]
    assert first[0].workers == p.chosen.workers - 1 and first[1].startswith("attainment ")
    assert "< 0.90" in first[1] and "saturated" in first[1]


def test_a_prefill_heavy_workload_gets_more_of_its_workers_prefilling():
    profile = _profile()
    heavy = plan(profile, PREFILL_HEAVY, SLO_, Budget(max_workers=8)).chosen.layout
    light = plan(profile, DECODE_HEAVY, SLO_, Budget(max_workers=8)).chosen.layout
    assert heavy.prefill / heavy.workers > light.prefill / light.workers


def test_a_rate_beyond_the_budget_is_reported_with_the_best_layout_there():
    profile = _profile()
    w = _workload(100.0, "1000", "16")
    p = plan(profile, w, SLO_, Budget(max_workers=4))
    assert not p.met and p.chosen.workers == 4
    assert p.max_rate is not None and 0 < p.max_rate < 100.0
    assert p.chosen.rate == p.max_rate and p.chosen.attainment >= 0.9
    asked = simulate(profile, p.chosen.layout, w, SLO_)
    assert asked.slo_attainment < 0.9
    # Every other layout of 4 workers lost on rate: it serves less, or misses the target at a rate
    # at most one bisection step (100 / 2^8 req/s) above the choice's.
    assert p.runners_up
    for e, why in p.runners_up:
        assert e.workers == 4
        if why.startswith("at most"):
            assert e.attainment >= 0.9 and e.rate <= p.max_rate
        else:
            assert why.startswith(f"at {e.rate:.2f} req/s, attainment") and e.attainment < 0.9
            assert e.rate <= p.max_rate + 100 / 256 + 1e-9


def test_the_closed_form_baseline():
    # Prefill 10 tokens/ms at any batch; a decode step of 10 + 1 x batch ms: a TPOT of 20 ms
    # allows a batch of 10 (step 20 ms: 500 tokens/s a worker).
    profile = dataclasses.replace(
        _profile(max_num_seqs=64), prefill=Linear(0.0, 0.1), decode=Linear(10.0, 1.0)
    )
    search = Search(profile, _workload(20.0, "1000", "100"), SLO(ttft_ms=5000.0, tpot_ms=20.0), 0.9)
    b = baseline(search, 2048)
    assert b.prefill_tok_s == pytest.approx(10_000.0)
    assert b.decode_batch == 10 and b.decode_tok_s == pytest.approx(500.0)
    # 20 req/s x 1000 tokens / 10,000 = 2 prefill workers; x 100 tokens / 500 = 4 decode workers;
    # colocated: 20 x (0.1 s + 0.2 s) = 6 workers.
    assert (b.prefill, b.decode, b.colocated) == (2, 4, 6)
    assert str(b.disaggregated_eval.layout) == "2p4d" and str(b.colocated_eval.layout) == "colocated:6"
    # A prompt longer than the chunk: its chunks one after another (no attention cost here).
    assert prefill_ms_per_prompt(profile, 1000, 512) == pytest.approx(100.0)


def test_budgets_chunks_and_traces():
    profile = _profile()
    assert Budget(max_workers=6, cores=8).workers(profile) == (4, "8 cores at 2 a worker")
    with pytest.raises(ValueError, match="no GPU"):
        Budget(gpus=4).workers(profile)
    gpu = dataclasses.replace(profile, machine=Machine("c", "avx2", 8, gpu="H200"))
    gpu = dataclasses.replace(gpu, engine=dataclasses.replace(gpu.engine, tensor_parallel_size=2))
    assert Budget(gpus=8).workers(gpu)[0] == 4
    with pytest.raises(ValueError, match="budget"):
        Budget().workers(profile)
    assert chunk_choices(profile)[0] == (2048,) and "the profile's" in chunk_choices(profile)[1]
    measured = dataclasses.replace(profile, points={"prefill": [{"tokens": 64}, {"tokens": 1024}]})
    assert chunk_choices(measured)[0] == (256, 512, 1024, 2048)
    trace = Workload(num_prompts=0, trace=tuple((i * 0.5, 100, 10) for i in range(5)))
    faster = at_rate(trace, 4.0)  # the trace's own rate is 2 req/s
    assert [r[0] for r in faster.trace] == [0.0, 0.25, 0.5, 0.75, 1.0]


def _baton() -> list[str]:
    exe = Path(sys.executable).with_name("baton")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.cli"]


def _plan_args(path: Path, rate: float, *extra: str) -> list[str]:
    args = ["plan", "--profile", str(path), "--rate", str(rate), "--input-len", "1000", "--output-len", "16"]
    return (
        _baton()
        + args
        + ["--slo", "ttft:1000", "tpot:30", "--max-workers", "8", "--num-prompts", "400", *extra]
    )


def test_cli_json_and_report(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    proc = subprocess.run(_plan_args(path, 12.0, "--json"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["layout"] == "2p1d" and out["met"] is True and out["slo_attainment"] >= 0.9
    for key in ("goodput_req_s", "p90_ttft_ms", "p90_tpot_ms", "pool_utilisation", "runners_up", "baseline"):
        assert key in out, key
    assert set(out["pool_utilisation"]) == {"prefill", "decode"}
    assert all(r["why"] for r in out["runners_up"])
    assert out["baseline"]["disaggregated"]["layout"] == "2p1d"
    text = subprocess.run(_plan_args(path, 100.0), capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("unmet: no layout of at most 8 workers")
    assert "runners-up:" in text.stdout and "baseline (replicas = load / profiled throughput" in text.stdout
    bad = subprocess.run(
        _plan_args(path, 1.0, "--attainment", "1.5"), capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "attainment target" in bad.stderr


# ---- the kustomize overlay ---------------------------------------------------------------------


def _render(folder: Path) -> list[dict]:
    from tests.e2e.k8s_render import render

    return render(folder)


def _validate(docs: list[dict]) -> None:
    import kubernetes_validate

    for doc in docs:
        if doc["apiVersion"] != "keda.sh/v1alpha1":
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def _find(docs: list[dict], kind: str, name: str) -> dict | None:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return hits[0] if hits else None


def test_the_kustomize_overlay_renders_the_plan(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    out = tmp_path / "overlay"
    base = ROOT / "k8s" / "overlays" / "cpu"
    args = _plan_args(path, 12.0, "--kustomize", str(out), "--kustomize-base", str(base), "--json")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["layout"] == "2p1d"
    docs = _render(out)
    _validate(docs)
    assert _find(docs, "Deployment", "baton-prefill")["spec"]["replicas"] == 2
    assert _find(docs, "Deployment", "baton-decode")["spec"]["replicas"] == 1
    prefill = _find(docs, "HorizontalPodAutoscaler", "baton-prefill")["spec"]
    decode = _find(docs, "HorizontalPodAutoscaler", "baton-decode")["spec"]
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (2, 7)  # the budget of 8 less 1 decode
    assert (decode["minReplicas"], decode["maxReplicas"]) == (1, 6)
    # Decode: the batch whose step meets the TPOT (32, max_num_seqs); prefill: the tokens a pod
    # clears in half the TTFT SLO.
    assert decode["metrics"][0]["pods"]["target"]["averageValue"] == "32"
    assert int(prefill["metrics"][0]["pods"]["target"]["averageValue"]) > 1000
    for role in ("prefill", "decode"):  # the plan's chunk, last on the workers' command lines
        args = _find(docs, "Deployment", f"baton-{role}")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[-2:] == ["--max-num-batched-tokens", "2048"]


def test_a_colocated_overlay_on_keda_has_no_prefill_pool(tmp_path):
    keda = tmp_path / "keda"
    keda.mkdir()
    (keda / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "baton",
                "resources": [os.path.relpath(ROOT / "k8s" / "base", keda)],
                "components": [os.path.relpath(ROOT / "k8s" / "components" / "keda", keda)],
            }
        )
    )
    out = tmp_path / "overlay"
    out.mkdir()
    body = overlay(parse_layout("colocated:3"), "../keda", 6, SLO_, 5000.0, 16)
    (out / "kustomization.yaml").write_text(json.dumps(body))
    docs = _render(out)
    _validate(docs)
    assert _find(docs, "Deployment", "baton-prefill")["spec"]["replicas"] == 0
    assert _find(docs, "ScaledObject", "baton-prefill") is None
    decode = _find(docs, "ScaledObject", "baton-decode")["spec"]
    assert (decode["minReplicaCount"], decode["maxReplicaCount"]) == (3, 6)
    assert decode["triggers"][0]["metadata"]["threshold"] == "16"
    assert decode["triggers"][2]["metadata"]["threshold"] == "0.03"  # the TPOT SLO, in seconds
    config = _find(docs, "ConfigMap", "baton-config")["data"]
    assert config["REMOTE_PREFILL_THRESHOLD"] == str(NEVER_REMOTE)
