"""``baton bench fidelity`` end to end on emulated workers (``baton up --emulate P``: the real
gateway, Redis and gRPC services, each engine step taking the profile's time): before its run the
speed probe (planner/probe.py) goes through the real gateway and reads the workers at the profile's
own speed, and the run's line carries the prediction at that speed beside the profile's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.planner.profile import Linear
from tests.planner_profiles import synthetic_profile

pytestmark = [pytest.mark.slow]

# Steps long enough that the modelled time, not the gateway's and the client's work on 2 busy cores,
# sets the pace: a 512-token prompt 200 ms, a decode step 60 ms.
PROFILE = synthetic_profile(
    Linear(100.0, 0.2),
    Linear(60.0, 0.5),
    transfer={"ucx": Linear(5.0, 0.01)},
    cpu="emulated test machine",
    model="SmolLM2-135M-Instruct",
    max_num_batched_tokens=512,
    max_num_seqs=32,
    kv_capacity_tokens=16384,
)


def test_the_probe_reads_emulated_workers_at_their_profiles_speed(tmp_path):
    profile, runs = tmp_path / "profile.json", tmp_path / "runs.jsonl"
    PROFILE.save(profile)
    cmd = [sys.executable, "-m", "baton.cli", "bench", "fidelity", "--profile", str(profile)]
    cmd += ["--layout", "colocated", "--mix", "64/16", "--loads", "0.3", "--arrivals", "poisson"]
    cmd += ["--window", "5", "--slo", "ttft:5000", "tpot:500", "--output-jsonl", str(runs)]
    cmd += ["--", "--emulate", str(profile)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (run,) = [json.loads(line) for line in runs.read_text().splitlines()]
    assert run["failed"] == 0 and run["measured_attainment"] == 1.0
    probe = run["probe"]
    print(f"probe: prefill {probe['prefill_ratio']:.2f}x, decode {probe['decode_ratio']:.2f}x the profile")
    sent = probe["requests"]
    assert sent["input_len"] == [512, 512, 128, 128, 128, 128] and not any(sent["error"])
    assert all(t > 0 for t in sent["ttft_ms"]) and all(t > 0 for t in sent["tpot_ms"][2:])
    # The emulated steps take the profile's time: the probe reads about the profile's speed (what
    # the served path adds, on a busy machine, is some tens of ms on 200-ms prefills and 60-ms steps).
    assert 0.8 <= probe["prefill_ratio"] <= 1.6, probe["prefill_ratio"]
    assert 0.8 <= probe["decode_ratio"] <= 1.6, probe["decode_ratio"]
    assert probe["predicted_attainment"] == 1.0
    assert probe["predicted_p90_tpot_ms"] >= run["predicted_p90_tpot_ms"] * probe["decode_ratio"] * 0.9
