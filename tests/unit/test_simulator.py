"""The simulator (planner/simulate.py, sim_engine.py): closed-form queueing results, exact timings of
single requests along both paths, KV capacity and preemption, routing over decode workers, and the
speed-up of runs of decode steps giving what step-by-step simulation gives."""

from __future__ import annotations

import dataclasses

import pytest

from baton.planner import sim_engine
from baton.planner.layout import parse_layout
from baton.planner.profile import Linear, Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import Simulator, simulate
from baton.planner.workload import Workload, draw, parse_lengths
from tests.planner_profiles import synthetic_profile


def _profile(**engine) -> Profile:
    return synthetic_profile(
        Linear(5.0, 0.05, 1e-5),
        Linear(10.0, 0.05, 0.001),
        transfer={"ucx": Linear(2.0, 0.01)},
        gateway_ms=1.5,
        **engine,
    )


def _one_step_per_token(step_ms: float) -> Profile:
    """One colocated worker serving one request at a time; free prefill and gateway, a constant
    decode step: a request's service time is (output tokens - 1) steps, its TTFT its queueing wait."""
    p = _profile(max_num_seqs=1)
    return dataclasses.replace(p, prefill=Linear(0.0, 0.0), decode=Linear(step_ms, 0.0), gateway_ms=0.0)


def _workload(rate: float, n: int, inp: str = "16", out: str = "16", **kw) -> Workload:
    return Workload(
        rate=rate, num_prompts=n, input_len=parse_lengths(inp), output_len=parse_lengths(out), **kw
    )


@pytest.mark.parametrize("out", ["11", "geometric:11"], ids=["M/D/1", "M/G/1-geometric"])
def test_queueing_wait_matches_pollaczek_khinchine(out):
    step_ms, lam = 1.0, 0.04  # arrivals per ms: rho = 0.4
    w = _workload(lam * 1000, 150_000, out=out)
    r = simulate(_one_step_per_token(step_ms), parse_layout("colocated"), w, SLO(), seed=1)
    service = [(o - 1) * step_ms for o in draw(w, 1).output_len]
    es = sum(service) / len(service)
    es2 = sum(s * s for s in service) / len(service)
    rho = lam * es
    assert 0.35 < rho < 0.45
    pk = lam * es2 / (2 * (1 - rho))
    assert r.completed == 150_000
    assert r.ttft_ms.mean == pytest.approx(pk, rel=0.02)
    if out == "11":  # deterministic service: TPOT is exactly one step
        assert r.tpot_ms.p99 == pytest.approx(step_ms)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_arrivals_have_the_asked_cv(cv):
    times = draw(_workload(100.0, 40_000, arrival="gamma", cv=cv), seed=2).arrival_s
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(0.01, rel=0.03)
    assert sd / mean == pytest.approx(cv, rel=0.05)


def test_draws_are_seeded():
    w = _workload(10.0, 100, inp="uniform:10:50", out="geometric:20")
    assert draw(w, 5) == draw(w, 5)
    assert draw(w, 5) != draw(w, 6)
    assert all(10 <= n <= 50 for n in draw(w, 5).input_len)


def test_single_colocated_request_costs_its_steps():
    p = _profile()
    r = simulate(p, parse_layout("colocated"), _workload(1.0, 1, inp="5000", out="4"), SLO(), seed=0)
    # Three chunks of the 2048-token budget, each attending to the chunks before it.
    chunks = [p.prefill_ms([(2048, 0)]), p.prefill_ms([(2048, 2048)]), p.prefill_ms([(904, 4096)])]
    ttft = p.gateway_ms + sum(chunks)
    decodes = sum(p.decode_ms(1, 5001 + i) for i in range(3))
    assert r.ttft_ms.mean == pytest.approx(ttft)
    assert r.e2e_ms.mean == pytest.approx(ttft + decodes)
    assert r.tpot_ms.mean == pytest.approx(decodes / 3)


def test_single_disaggregated_request_hands_its_first_token_over():
    p = _profile()
    r = simulate(p, parse_layout("1p1d"), _workload(1.0, 1, inp="1000", out="3"), SLO(), seed=0)
    # The prefill worker samples the first token; it reaches the client when the KV has landed
    # and the (idle) decode worker resumes the request.
    link = p.transfer["ucx"]
    ttft = p.gateway_ms + p.prefill_ms([(1000, 0)]) + link.a + link.b * 1000
    assert r.ttft_ms.mean == pytest.approx(ttft)
    assert r.e2e_ms.mean == pytest.approx(ttft + p.decode_ms(1, 1001) + p.decode_ms(1, 1002))
    assert r.remote_prefills == 1


def test_short_prompts_are_prefilled_by_the_decode_worker():
    r = simulate(_profile(), parse_layout("1p1d"), _workload(5.0, 50, inp="20"), SLO(), seed=0)
    assert r.completed == 50 and r.remote_prefills == 0
    assert r.pool_utilisation["prefill"] == 0.0


def test_runs_of_decode_steps_match_step_by_step(monkeypatch):
    w = _workload(8.0, 400, inp="uniform:20:600", out="geometric:150")
    layout, p = parse_layout("2p2d"), _profile(kv_capacity_tokens=3_000)
    fast = simulate(p, layout, w, SLO(300, 30), seed=4)
    monkeypatch.setattr(sim_engine, "MAX_RUN_STEPS", 1)
    slow = simulate(p, layout, w, SLO(300, 30), seed=4)
    assert slow.events > 3 * fast.events
    assert fast.preemptions > 0  # the shortage path ran too
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for q in ("p50", "p90", "p99", "mean"):
            assert getattr(getattr(fast, name), q) == pytest.approx(getattr(getattr(slow, name), q), rel=1e-9)
    assert (fast.slo_attainment, fast.preemptions) == (slow.slo_attainment, slow.preemptions)


def _kv_bound(capacity_tokens: int):
    p = _profile(max_num_seqs=8, kv_capacity_tokens=capacity_tokens)
    w = _workload(50.0, 300, inp="100", out="200")  # 300 tokens: 19 blocks a request at its end
    return simulate(p, parse_layout("colocated"), w, SLO(), seed=3)


def test_kv_capacity_forces_preemption_only_when_short():
    roomy = _kv_bound(8 * 19 * 16)  # every running request can reach its last token
    tight = _kv_bound(64 * 16)
    assert roomy.preemptions == 0
    assert tight.preemptions > 0
    assert tight.completed == roomy.completed == 300
    assert tight.tpot_ms.mean > roomy.tpot_ms.mean


def test_more_decode_workers_lower_tpot_under_load():
    w = _workload(30.0, 1500, inp="200", out="100")
    one = simulate(_profile(), parse_layout("1p1d"), w, SLO(), seed=0)
    four = simulate(_profile(), parse_layout("1p4d"), w, SLO(), seed=0)
    assert four.tpot_ms.p90 < 0.8 * one.tpot_ms.p90
    busy = [v for k, v in four.utilisation.items() if k.startswith("decode")]
    assert max(busy) - min(busy) < 0.1  # the router spreads the load


def test_slo_attainment_and_goodput():
    w = _workload(20.0, 2000, inp="200", out="50")
    loose = simulate(_profile(), parse_layout("colocated:2"), w, SLO(10_000, 1_000), seed=0)
    none_met = simulate(_profile(), parse_layout("colocated:2"), w, SLO(1.0, 1.0), seed=0)
    assert loose.slo_attainment == 1.0
    assert loose.goodput_req_s == pytest.approx(2000 / loose.window_s)
    assert none_met.slo_attainment == 0.0 and none_met.goodput_req_s == 0.0


def test_a_prompt_no_worker_can_hold_is_rejected():
    w = _workload(1.0, 3, inp="5000", out="10")
    r = simulate(_profile(kv_capacity_tokens=4096), parse_layout("1p1d"), w, SLO(), seed=0)
    assert (r.rejected, r.completed, r.slo_attainment) == (3, 0, 0.0)


@pytest.mark.parametrize("layout", ["2p2d", "colocated:2", "1p1d"])
def test_every_block_comes_back(layout):
    w = _workload(12.0, 400, inp="uniform:20:600", out="geometric:150")
    sim = Simulator(_profile(kv_capacity_tokens=2_500), parse_layout(layout), draw(w, 4), SLO())
    sim.run()
    r = sim.result()
    assert r.completed == 400 and r.preemptions > 0
    for engine in sim.engines:
        engine.check_integrity()
        assert engine.free == engine.capacity and engine.ctx == 0 and not engine.waiting


def test_a_missing_transport_is_named():
    w = _workload(1.0, 5, inp="100")
    with pytest.raises(ValueError, match="no 'nccl' model .*ucx"):
        simulate(_profile(), "1p1d", w, SLO(), transport="nccl")
    assert simulate(_profile(), "colocated", w, SLO(), transport="nccl").completed == 5


def test_a_prompt_arriving_mid_decode_shares_a_mixed_step():
    # B arrives while A decodes: it waits for A's step in flight to end, then its prefill and A's
    # decode run as one step, which pays the fixed per-step cost once.
    p = _profile()
    trace = ((0.0, 100, 50), (0.1, 60, 5))
    r = simulate(p, "colocated", Workload(num_prompts=0, trace=trace), SLO(), seed=0)
    t, ctx = p.gateway_ms + p.prefill_ms([(100, 0)]), 101  # A's first token
    arrival_b = 100.0 + p.gateway_ms
    while t < arrival_b:
        t += p.decode_ms(1, ctx)
        ctx += 1
    mixed = p.prefill_ms([(60, 0)]) + p.decode_ms(1, ctx) - min(p.prefill.a, p.decode.a)
    ttft_a, ttft_b = p.gateway_ms + p.prefill_ms([(100, 0)]), t + mixed - 100.0
    assert r.ttft_ms.mean == pytest.approx((ttft_a + ttft_b) / 2)


def test_prefill_routing_spreads_queued_tokens():
    w = _workload(12.0, 600, inp="uniform:500:3000", out="8")
    one = simulate(_profile(), "1p2d", w, SLO(), seed=0)
    two = simulate(_profile(), "2p2d", w, SLO(), seed=0)
    assert one.pool_utilisation["prefill"] > 0.6  # loaded enough for the choice to matter
    busy = [v for k, v in two.utilisation.items() if k.startswith("prefill")]
    # Both take a fair share; ties (both idle) go to the first, as the router's go by worker id.
    assert 0.4 < busy[1] <= busy[0] < busy[1] + 0.15
    assert two.ttft_ms.p90 < 0.7 * one.ttft_ms.p90


def test_the_hosts_work_for_streamed_tokens_slows_a_busy_workers_steps():
    # One worker: no core is idle for the host's 2 ms a token, so a constant 10 ms decode step that
    # streams one token takes 10 / (1 - 2 / 10) = 12.5 ms; the prefill step streams none.
    base = dataclasses.replace(_profile(), decode=Linear(10.0, 0.0))
    w = _workload(1.0, 1, inp="100", out="5")
    plain = simulate(base, "colocated", w, SLO(), seed=0)
    slowed = simulate(dataclasses.replace(base, host_ms=2.0), "colocated", w, SLO(), seed=0)
    assert slowed.ttft_ms.mean == pytest.approx(plain.ttft_ms.mean)
    assert plain.tpot_ms.mean == pytest.approx(10.0)
    assert slowed.tpot_ms.mean == pytest.approx(12.5)


def test_the_hosts_work_takes_an_idle_workers_core_first():
    # Prompts under the remote-prefill threshold never reach the prefill worker: its core takes the
    # host's work whole while that is under one core, and only the rest slows the decode steps.
    w = _workload(20.0, 200, inp="16", out="uniform:20:60")
    base = _profile()
    plain = simulate(base, "1p1d", w, SLO(), seed=0)
    light = simulate(dataclasses.replace(base, host_ms=0.2), "1p1d", w, SLO(), seed=0)
    heavy = simulate(dataclasses.replace(base, host_ms=2.0), "1p1d", w, SLO(), seed=0)
    assert plain.remote_prefills == 0 and plain.pool_utilisation["prefill"] == 0.0
    assert light.tpot_ms.mean == pytest.approx(plain.tpot_ms.mean, rel=1e-12)
    assert light.e2e_ms.p90 == pytest.approx(plain.e2e_ms.p90, rel=1e-12)
    assert heavy.tpot_ms.mean > 1.2 * plain.tpot_ms.mean
    # colocated, the same work has no idle core to go to
    assert simulate(dataclasses.replace(base, host_ms=0.2), "colocated", w, SLO(), seed=0).tpot_ms.mean > (
        simulate(base, "colocated", w, SLO(), seed=0).tpot_ms.mean
    )
