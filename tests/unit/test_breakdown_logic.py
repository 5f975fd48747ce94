"""The arithmetic of ``baton bench breakdown`` and the /proc readings it rests on."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from baton.bench import proc_stats
from baton.bench.breakdown import Breakdown, bars, delta, first_token_figures, per_token_figures, scrape

METRICS = """\
# HELP baton:engine_steps_total Engine steps run.
# TYPE baton:engine_steps_total counter
baton:engine_steps_total{model_name="m",worker="decode-a"} 10.0
baton:engine_steps_total{model_name="m",worker="decode-b"} 30.0
# HELP baton:engine_step_seconds_total Time in engine steps.
# TYPE baton:engine_step_seconds_total counter
baton:engine_step_seconds_total{model_name="m",worker="decode-a"} 1.0
baton:engine_step_seconds_total{model_name="m",worker="decode-b"} 1.0
# HELP baton:gateway_chunk_lag_seconds lag
# TYPE baton:gateway_chunk_lag_seconds summary
baton:gateway_chunk_lag_seconds_count{stage="received"} 4.0
baton:gateway_chunk_lag_seconds_sum{stage="received"} 0.002
baton:gateway_chunk_lag_seconds_count{stage="written"} 4.0
baton:gateway_chunk_lag_seconds_sum{stage="written"} 0.006
"""


def test_scrape_sums_over_workers_and_keeps_other_labels():
    got = scrape(METRICS)
    assert got["baton:engine_steps_total"] == 40.0
    assert got["baton:engine_step_seconds_total"] == 2.0
    assert got["baton:gateway_chunk_lag_seconds_count{stage=received}"] == 4.0
    assert got["baton:gateway_chunk_lag_seconds_sum{stage=written}"] == pytest.approx(0.006)


def test_per_token_figures_divide_the_window_by_its_steps_and_chunks():
    before = {"baton:engine_steps_total": 10.0, "baton:engine_step_seconds_total": 0.5}
    after = {
        "baton:engine_steps_total": 110.0,
        "baton:engine_step_seconds_total": 3.5,  # 3 s over 100 steps: 30 ms a step
        "baton:engine_forward_seconds_total": 2.5,
        "baton:engine_detokenize_seconds_total": 0.1,
        "baton:stream_handoff_seconds_count": 100.0,
        "baton:stream_handoff_seconds_sum": 0.05,
    }
    gw = scrape(METRICS)
    f = per_token_figures(delta(before, after), gw)
    assert f["engine_step"] == pytest.approx(30.0)
    assert f["engine_forward_and_sampling"] == pytest.approx(25.0)
    assert f["engine_detokenize"] == pytest.approx(1.0)
    assert f["engine_rest_of_step"] == pytest.approx(4.0)
    assert f["worker_handoff_lag"] == pytest.approx(0.5)
    assert f["gateway_received_lag"] == pytest.approx(0.5)
    assert f["gateway_written_lag"] == pytest.approx(1.5)
    assert math.isnan(per_token_figures({}, {})["engine_step"])  # no step in the window: no figure


def test_first_token_figures_are_per_request():
    prefill = {
        "baton:engine_step_seconds_total": 0.9,
        "baton:engine_forward_seconds_total": 0.6,
        "baton:kv_transfer_seconds_count": 3.0,
        "baton:kv_transfer_seconds_sum": 0.03,
    }
    ttft = {"baton:time_to_first_token_seconds_count": 3.0, "baton:time_to_first_token_seconds_sum": 0.6}
    f = first_token_figures(prefill, ttft, ttft, requests=3)
    assert f == pytest.approx(
        {
            "gateway_ttft": 200.0,
            "decode_worker_ttft": 200.0,
            "prefill_worker_steps": 300.0,
            "prefill_worker_forward": 200.0,
            "kv_transfer": 10.0,
        }
    )


def test_bars_compare_with_the_offline_engine():
    b = Breakdown(config={}, per_token_ms={"client_tpot": 22.0, "client_ttft": 150.0})
    b.offline = {"decode_ms_per_token": 20.0, "prefill_ms": 100.0}
    r = bars(b)
    assert r["tpot_over_offline"] == pytest.approx(1.1) and r["tpot_bar_met"]
    assert r["ttft_bar_ms"] == pytest.approx(140.0) and not r["ttft_bar_met"]


def test_proc_stats_see_a_busy_child_and_its_role():
    # A child shaped like a baton up service: its command line names ``baton.cli decode``.
    # It spins until it has *used* 0.5 s of CPU (not for 0.5 s of wall time: on a busy runner that
    # was less CPU than the 0.3 s the test waits to see).
    spin = "import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spin, "baton.cli", "decode"])
    try:
        before = proc_stats.sample(child.pid)
        deadline = time.monotonic() + 20
        while proc_stats.sample(child.pid).cpu_s - before.cpu_s < 0.3:
            assert time.monotonic() < deadline, "the child never used 0.3 s of CPU"
            time.sleep(0.05)
        after = proc_stats.sample(child.pid)
        found = proc_stats.cluster_pids(os.getpid())
        assert found.get("decode-0") == child.pid
        use = proc_stats.usage({"decode-0": before}, {"decode-0": after}, seconds=1.0)
        assert use["decode-0"]["cpu_s"] == pytest.approx(after.cpu_s - before.cpu_s)
        assert use["decode-0"]["cpu_percent"] == pytest.approx(100 * use["decode-0"]["cpu_s"])
    finally:
        child.kill()
        child.wait()
