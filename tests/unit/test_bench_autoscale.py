"""``baton bench autoscale``'s command line and report: emulated workers by default, real ones with
``--real``, lost requests counted."""

from __future__ import annotations

from baton.bench.autoscale_emulated import AutoscaleBench, report, up_command
from baton.bench.autoscale_figures import step_trace
from baton.bench.serve_client import RequestResult


def bench(**kw) -> AutoscaleBench:
    base = dict(
        profile="/p.json",
        layout="1p1d",
        rate=2.0,
        phase_a_s=10.0,
        phase_b_s=5.0,
        input_len=16,
        output_len=8,
        slo=(1500.0, 50.0),
    )
    return AutoscaleBench(**{**base, **kw})


def test_emulated_by_default_real_without_emulate():
    emulated = up_command(bench())
    assert emulated[:2] == ["--emulate", "/p.json"]
    real = up_command(bench(emulated=False))
    assert "--emulate" not in real
    assert real[:5] == ["--layout", "1p1d", "--autoscale", "--profile", "/p.json"]


class Poll:
    busy = [(101.0, 0.5)]
    samples = [(100.0, {"decode": 1}), (106.0, {"decode": 1}), (112.0, {"decode": 2})]


def test_the_report_counts_lost_requests_and_says_what_ran():
    b = bench(emulated=False)
    rows = step_trace(b.rate, b.phase_a_s, b.phase_b_s, b.input_len, b.output_len, b.seed)
    t0 = 100.0
    results = []
    for i, (t, _, _) in enumerate(rows):
        ok = i != 1
        r = RequestResult(success=ok, error="" if ok else "stream cut", output_len=8 if ok else 0)
        r.start, r.ttft, r.latency = t0 + t, 0.1, 0.1 + 7 * 0.02
        results.append(r)
    lines = [(t0 + 11.0, "autoscale: decode 1 -> 2 (rate 4.0 req/s)")]
    out = report(b, rows, t0, results, lines, Poll())
    assert out["label"] == "real" and "REAL" in out["what"]
    assert out["figures"]["failed_requests"] == 1
    assert out["workers"] == [
        {"t_s": 0.0, "registered": {"decode": 1}},
        {"t_s": 12.0, "registered": {"decode": 2}},
    ]
    assert out["figures"]["cpu_busy_constant"] == 0.5
