"""What ``baton simulate`` reads: layouts, length distributions, SLOs, traces, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.planner.layout import Layout, parse_layout
from baton.planner.profile import EngineShape, Linear, Machine, Profile
from baton.planner.sim_result import SLO, parse_slo
from baton.planner.simulate import simulate
from baton.planner.workload import Lengths, Workload, draw, load_trace, parse_lengths


@pytest.mark.parametrize(
    "text, expected",
    [
        ("colocated", Layout(0, 1, True)),
        ("colocated:4", Layout(0, 4, True)),
        ("1p1d", Layout(1, 1, False)),
        ("300p700d", Layout(300, 700, False)),
        (" 2P3D ", Layout(2, 3, False)),
    ],
)
def test_layouts_parse(text, expected):
    layout = parse_layout(text)
    assert layout == expected
    assert parse_layout(str(layout)) == layout


@pytest.mark.parametrize(
    "text", ["", "p1d", "0p1d", "1p0d", "2p", "colocated:0", "colocated:x", "3d1p", "1p1d2"]
)
def test_bad_layouts_say_what_is_expected(text):
    with pytest.raises(ValueError, match=r"layout .*(expected|at least)"):
        parse_layout(text)


def test_lengths_parse():
    assert parse_lengths("128") == Lengths("fixed", 128)
    assert parse_lengths(64) == Lengths("fixed", 64)
    assert parse_lengths("uniform:10:20") == Lengths("uniform", 10, 20)
    assert parse_lengths("geometric:50").mean == 50
    for bad in ("0", "uniform:5:1", "zipf:3", "geometric", "abc"):
        with pytest.raises(ValueError, match="lengths"):
            parse_lengths(bad)


def test_geometric_lengths_have_their_mean():
    w = Workload(rate=1.0, num_prompts=50_000, output_len=parse_lengths("geometric:40"))
    outs = draw(w, seed=1).output_len
    assert min(outs) == 1
    assert sum(outs) / len(outs) == pytest.approx(40, rel=0.03)


def test_slo_parse():
    assert parse_slo(["ttft:500", "tpot:50"]) == SLO(500.0, 50.0)
    assert parse_slo(["tpot:20"]) == SLO(tpot_ms=20.0)
    for bad in (["e2e:5"], ["ttft"], ["ttft:fast"]):
        with pytest.raises(ValueError, match="SLO"):
            parse_slo(bad)


def _rows():
    return [(100.0, 50, 4), (100.25, 70, 2), (101.0, 30, 9)]


def test_jsonl_and_csv_traces_replay_exactly(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"timestamp": t, "input_len": i, "output_len": o}) + "\n" for t, i, o in _rows())
    )
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("timestamp,input_len,output_len\n" + "".join(f"{t},{i},{o}\n" for t, i, o in _rows()))
    expected = ((0.0, 50, 4), (0.25, 70, 2), (1.0, 30, 9))
    for path in (jsonl, csv_path):
        trace = load_trace(path)
        assert trace == expected
        req = draw(Workload(num_prompts=0, trace=trace), seed=9)
        assert (req.arrival_s, req.input_len, req.output_len) == ([0.0, 0.25, 1.0], [50, 70, 30], [4, 2, 9])


def test_a_trace_without_its_columns_is_refused(tmp_path):
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"ts": 1, "input_len": 3}) + "\n")
    with pytest.raises(ValueError, match="timestamp, input_len and output_len"):
        load_trace(bad)


def _profile() -> Profile:
    return Profile(
        machine=Machine(cpu="test", isa="avx2", cores=1),
        engine=EngineShape("m", "bfloat16", None, "auto", 1, 16, 512, 32, 50_000),
        prefill=Linear(4.0, 0.04, 1e-5),
        decode=Linear(8.0, 0.1, 0.001),
        transfer={"ucx": Linear(1.0, 0.002)},
        gateway_ms=1.0,
        taken_at="2026-12-05T00:00:00Z",
    )


def test_a_replayed_trace_is_served_as_given(tmp_path):
    trace = tuple((i * 2.0, 64, 3) for i in range(5))  # far apart: nobody waits
    r = simulate(_profile(), parse_layout("colocated"), Workload(num_prompts=0, trace=trace), SLO(), seed=0)
    p = _profile()
    assert r.num_requests == r.completed == 5 and r.window_s == 8.0
    assert r.ttft_ms.p99 == pytest.approx(p.gateway_ms + p.prefill_ms([(64, 0)]))


def _baton() -> list[str]:
    exe = Path(sys.executable).with_name("baton")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "baton.cli"]


def test_cli_prints_one_json_object(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    args = ["simulate", "--profile", str(path), "--layout", "2p3d", "--rate", "20", "--num-prompts", "300"]
    args += ["--input-len", "200", "--output-len", "20", "--arrival", "gamma", "--cv", "2", "--seed", "3"]
    args += ["--slo", "ttft:500", "tpot:50", "--json"]
    proc = subprocess.run(_baton() + args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("slo_attainment", "goodput_req_s", "p90_ttft_ms", "p90_tpot_ms", "wall_s", "preemptions"):
        assert key in out, key
    assert 0.0 <= out["slo_attainment"] <= 1.0 and out["num_requests"] == 300
    assert out["layout"] == "2p3d" and set(out["pool_utilisation"]) == {"prefill", "decode"}


def test_cli_table_and_errors(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    base = _baton() + ["simulate", "--profile", str(path), "--num-prompts", "50", "--rate", "5"]
    table = subprocess.run(base + ["--layout", "colocated:2"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "TTFT ms" in table.stdout and "SLO attainment" in table.stdout
    bad = subprocess.run(base + ["--layout", "2x3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected 'colocated'" in bad.stderr
