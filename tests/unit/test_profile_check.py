"""``baton profile``'s pure parts (bench/profile_plan.py): the check's decision on fixed drifts, the reduced grid it
re-measures, the engine-shape comparison, and the relative-error fit it writes."""

from __future__ import annotations

import dataclasses

import pytest

from baton.bench.profile_engine import DecodePoint, PrefillPoint
from baton.bench.profile_plan import (
    CHECK_ROUNDS,
    failing,
    fit_errors,
    fit_points,
    flag_mismatch,
    format_drift,
    grid_plan,
    least_drift,
    reduced_plan,
    shape_mismatch,
)
from baton.planner.profile import EngineShape, Linear, Machine, Profile, attention_pairs, drift, fit

SHAPE = EngineShape("SmolLM2-135M-Instruct", "bfloat16", None, "auto", 1, 16, 2048, 256, 100_000)
PREFILL = Linear(10.0, 0.8, 2e-4)
DECODE = Linear(9.0, 0.5, 1e-3)
UCX = Linear(1.0, 0.005)


def _points() -> dict[str, list[dict[str, float]]]:
    prefill = []
    for prior in (0, 512, 1024):
        for t in (32, 256, 1024):
            pairs = attention_pairs([(t, prior)])
            prefill.append(
                {"tokens": t, "pairs": pairs, "prior": prior, "pieces": 1, "ms": PREFILL(t, pairs)}
            )
    packed = attention_pairs([(64, 0)] * 4)
    prefill.append({"tokens": 256, "pairs": packed, "prior": 0, "pieces": 4, "ms": PREFILL(256, packed)})
    decode = [
        {"batch": b, "context": b * c, "context_per_seq": c, "ms": DECODE(b, b * c)}
        for b in (1, 8, 32)
        for c in (128, 1024)
    ]
    ucx = [{"tokens": n, "ms": UCX(n)} for n in (256, 2048, 8192)]
    return {"prefill": prefill, "decode": decode, "transfer.ucx": ucx}


def _profile(points=None, scale: float = 1.0) -> Profile:
    def s(lin: Linear) -> Linear:
        return Linear(lin.a * scale, lin.b * scale, lin.c * scale)

    return Profile(
        machine=Machine("AMD EPYC (family 25 model 17)", "avx512-bf16", 2),
        engine=SHAPE,
        prefill=s(PREFILL),
        decode=s(DECODE),
        transfer={"ucx": s(UCX)},
        gateway_ms=2.0 * scale,
        taken_at="2026-12-05T00:00:00Z",
        points=_points() if points is None else points,
    )


def test_failing_names_the_models_past_the_tolerance_and_no_others():
    drifts = {"prefill": 0.04, "decode": 0.12, "transfer.ucx": 0.10, "gateway": 0.5}
    assert failing(drifts) == ["decode", "gateway"]  # 0.10 is within a 10% tolerance
    assert failing(drifts, tolerance=0.6) == []
    assert failing(drifts, tolerance=0.05) == ["decode", "gateway", "transfer.ucx"]
    assert failing({}) == []
    text = format_drift(drifts, 0.10)
    assert "decode" in text and "12.0%  FAIL" in text and "4.0%  ok" in text and "time now" not in text
    text = format_drift(drifts, 0.10, {"decode": 1.12, "prefill": 0.96})
    assert "12.0%  FAIL (tolerance 10%)  time now 1.12x the profile's" in text
    assert "4.0%  ok (tolerance 10%)  time now 0.96x" in text


def test_a_halved_profile_drifts_past_the_check_and_an_equal_one_does_not():
    stored = _profile()
    assert failing(drift(stored, _profile(scale=1.0))) == []
    halved = _profile(scale=0.5)
    drifts = drift(halved, stored)  # the machine now takes twice the stored times
    assert failing(drifts) == ["decode", "gateway", "prefill", "transfer.ucx"]
    assert drifts["prefill"] == pytest.approx(1.0)


def test_the_fit_recovers_the_models_from_their_points_with_no_error():
    prefill, decode, transfer = fit_points(_points())
    for got, want in ((prefill, PREFILL), (decode, DECODE), (transfer["ucx"], UCX)):
        assert (got.a, got.b, got.c) == pytest.approx((want.a, want.b, want.c), rel=1e-6)
    errors = fit_errors(_profile())
    assert max(errors.values()) < 1e-9


def test_weighted_fit_serves_small_points_where_a_plain_one_does_not():
    xs = [16, 64, 256, 1024, 2048]
    ms = [12.0, 40.0, 150.0, 1000.0, 1900.0]  # small steps cheaper than a line through big ones
    plain = fit(xs, [0] * 5, ms)
    relative = fit(xs, [0] * 5, ms, weights=[1 / m for m in ms])

    def squared_relative(lin: Linear) -> float:
        return sum(((lin(x) - m) / m) ** 2 for x, m in zip(xs, ms))

    assert squared_relative(relative) < squared_relative(plain) / 3
    assert abs(relative(16) - 12.0) / 12.0 < 0.1 < abs(plain(16) - 12.0) / 12.0  # plain: 0 ms (clamped)
    with pytest.raises(ValueError):
        fit(xs, [0] * 5, ms, weights=[1.0])


def test_the_check_remeasures_the_prefill_corners_and_every_decode_point():
    plan, at_points = reduced_plan(_profile(), quick=True)
    assert set(plan.prefill) == {PrefillPoint(1, t, p) for t in (32, 256, 1024) for p in (0, 1024)}
    assert set(plan.decode) == {DecodePoint(b, c) for b in (1, 8, 32) for c in (128, 1024)}
    assert plan.transfer_tokens == (256, 2048, 8192) and plan.transports == ("ucx",)
    assert plan.gateway_requests > 0 and not plan.chunked
    assert len(at_points.points["prefill"]) == 6  # the packed point and the middle prior are left out
    assert all(p["pieces"] == 1 and p["prior"] in (0, 1024) for p in at_points.points["prefill"])
    assert len(at_points.points["decode"]) == 6


def test_the_check_derives_priors_from_pairs_and_skips_an_absent_gateway():
    points = _points()
    for p in points["prefill"]:
        del p["prior"]
    for p in points["decode"]:
        del p["context_per_seq"]
    stored = dataclasses.replace(_profile(points), gateway_ms=0.0)
    plan, _ = reduced_plan(stored, quick=True)
    assert {p.prior for p in plan.prefill} == {0, 1024}
    assert {p.context for p in plan.decode} == {128, 1024}
    assert plan.gateway_requests == 0


def test_shape_mismatch_names_the_differing_fields_but_not_the_capacity():
    other = dataclasses.replace(SHAPE, dtype="float32", kv_capacity_tokens=5)
    assert shape_mismatch(SHAPE, dataclasses.replace(SHAPE, kv_capacity_tokens=5)) == []
    assert shape_mismatch(SHAPE, other) == ["dtype: stored 'bfloat16', now 'float32'"]
    flags = {"model": None, "dtype": "auto", "block_size": 16, "max_num_seqs": 256, "quantization": None}
    assert flag_mismatch(SHAPE, flags) == []  # auto: known once the engine resolves it
    assert flag_mismatch(SHAPE, flags | {"dtype": "float32", "block_size": 32}) == [
        "dtype: stored 'bfloat16', now 'float32'",
        "block_size: stored 16, now 32",
    ]


def test_the_default_grid_has_chunked_and_packed_steps_and_the_quick_one_is_small():
    full, quick = grid_plan(quick=False), grid_plan(quick=True)
    assert full.chunked and any(p.pieces > 1 for p in full.prefill)
    assert any(p.prior > 0 for p in quick.prefill) and len(quick.prefill) <= 6
    assert len(quick.decode) <= 6 and len(quick.transfer_tokens) == 2


def test_a_model_is_judged_by_its_least_drift_over_the_rounds():
    first = {"prefill": 0.03, "decode": 0.02, "transfer.ucx": 0.12}  # one noisy transfer run
    again = {"prefill": 0.05, "decode": 0.01, "transfer.ucx": 0.04}
    least = least_drift(first, again)
    assert least == {"prefill": 0.03, "decode": 0.01, "transfer.ucx": 0.04}
    assert failing(first) == ["transfer.ucx"] and failing(least) == []
    moved = {"prefill": 0.5, "decode": 0.02, "transfer.ucx": 0.04}  # a real change stays in every round
    assert failing(least_drift(moved, {**moved, "prefill": 0.45})) == ["prefill"]
    assert CHECK_ROUNDS >= 2
