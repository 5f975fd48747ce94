"""The profile's models: least-squares fits recover known coefficients, the JSON round-trips, drift
is measured at the stored points and a foreign version is refused."""

from __future__ import annotations

import json

import pytest

from baton.planner.profile import (
    VERSION,
    Linear,
    Profile,
    attention_pairs,
    drift,
    fit,
    time_ratio,
)
from tests.planner_profiles import synthetic_profile


def _profile(scale: float = 1.0) -> Profile:
    return synthetic_profile(
        Linear(5.0 * scale, 0.05 * scale, 1e-5 * scale),
        Linear(8.0 * scale, 0.1 * scale, 0.001 * scale),
        transfer={"ucx": Linear(1.0 * scale, 0.002 * scale)},
        gateway_ms=1.5 * scale,
        cores=2,
        cpu="AMD EPYC (family 25 model 17)",
        isa="avx512-bf16",
        model="SmolLM2-135M-Instruct",
        kv_capacity_tokens=100_000,
        points={
            "prefill": [
                {"tokens": 256, "pairs": 32896, "ms": 18.1},
                {"tokens": 2048, "pairs": 2098176, "ms": 128},
            ],
            "decode": [{"batch": 1, "context": 300, "ms": 8.4}, {"batch": 64, "context": 20000, "ms": 34}],
            "transfer.ucx": [{"tokens": 512, "ms": 2.0}],
        },
    )


def test_fit_recovers_a_plane_and_a_line():
    xs, ys = [1, 2, 3, 4, 5, 6], [3, 1, 4, 1, 5, 9]
    got = fit(xs, ys, [2 + 0.5 * x + 0.25 * y for x, y in zip(xs, ys)])
    assert got.a == pytest.approx(2) and got.b == pytest.approx(0.5) and got.c == pytest.approx(0.25)
    line = fit([10, 20, 40], [0, 0, 0], [6, 11, 21])
    assert (line.a, line.b, line.c) == (pytest.approx(1), pytest.approx(0.5), 0.0)


def test_fit_refuses_points_that_do_not_determine_it():
    with pytest.raises(ValueError):
        fit([1], [0], [1])
    with pytest.raises(ValueError):
        fit([1, 2, 3], [2, 4, 6], [1, 2, 3])  # y a multiple of x: c and b not separable


def test_attention_pairs_counts_prior_and_causal_pairs():
    assert attention_pairs([(1, 0)]) == 1
    assert attention_pairs([(4, 0)]) == 10
    assert attention_pairs([(4, 100), (2, 0)]) == 4 * 100 + 10 + 3


def test_predictors_and_a_round_trip(tmp_path):
    p = _profile()
    assert p.prefill_ms([(256, 0)]) == pytest.approx(5 + 0.05 * 256 + 1e-5 * attention_pairs([(256, 0)]))
    assert p.decode_ms(0, 0) == 0.0
    assert p.decode_ms(4, 1000) == pytest.approx(8 + 0.4 + 1)
    assert p.transfer_ms(1000) == pytest.approx(3.0)
    path = tmp_path / "p.json"
    p.save(path)
    assert Profile.load(path) == p
    assert json.loads(path.read_text())["version"] == VERSION


def test_a_foreign_version_is_refused(tmp_path):
    d = json.loads(_profile().to_json())
    d["version"] = VERSION + 1
    with pytest.raises(ValueError, match="version"):
        Profile.from_dict(d)


def test_drift_is_the_worst_relative_difference_per_model():
    assert all(v == pytest.approx(0) for v in drift(_profile(), _profile()).values())
    d = drift(_profile(), _profile(1.12))
    assert set(d) == {"prefill", "decode", "transfer.ucx", "gateway"}
    assert all(v == pytest.approx(0.12) for v in d.values())
    # a machine 12% faster drifts as far; time_ratio keeps the direction
    assert drift(_profile(), _profile(0.88)) == pytest.approx(d)
    assert time_ratio(_profile(), _profile(1.12)) == pytest.approx(dict.fromkeys(d, 1.12))
    assert time_ratio(_profile(), _profile(0.88)) == pytest.approx(dict.fromkeys(d, 0.88))
