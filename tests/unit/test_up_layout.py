"""``baton up --layout`` and ``--plan`` (services/up_cli.py ``apply_up_layout``, services/layout.py):
a layout as ``baton simulate``/``baton plan`` name it becomes the worker counts ``baton up`` starts,
and the layout rule then only pins them to cores."""

from __future__ import annotations

import json

import pytest

from baton.cli.main import build_parser
from baton.services.layout import LayoutRequest, fixed_layout, plan, plan_layout
from baton.services.up_cli import apply_up_layout


def _up(*args: str):
    a = build_parser().parse_args(["up", "--dtype", "float32", *args])
    ok = apply_up_layout(a)
    return a, ok


def _started(a, cores: list[int]):
    """What ``baton up`` would start on ``cores``: (prefill, decode, cpu lists)."""
    got = plan(cores, LayoutRequest(a.prefill, a.decode, a.colocated, a.cpus, a.dtype), None)
    return got.prefill, got.decode, got.cpus


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("1p1d", (1, 1, False)),
        ("2p4d", (2, 4, False)),
        ("colocated", (0, 1, True)),
        ("colocated:3", (0, 3, True)),
    ],
)
def test_layouts_map_to_the_worker_flags(layout, expected):
    assert fixed_layout(layout) == expected


def test_the_layout_decides_the_workers_and_the_rule_only_pins_them():
    a, ok = _up("--layout", "1p1d")
    assert ok and (a.prefill, a.decode, a.colocated) == (1, 1, False)
    assert _started(a, [0, 1]) == (1, 1, "0|1")  # no probe needed: the layout is fixed
    a, ok = _up("--layout", "colocated:2")
    assert ok and _started(a, [0, 1, 2, 3]) == (0, 2, "0,1|2,3")
    a, ok = _up("--layout", "2p3d")
    assert ok and _started(a, list(range(8))) == (2, 3, "0|1|2,3|4,5|6,7")


def test_a_plan_file_is_applied(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"layout": "2p1d", "chunk": 512, "met": True, "slo_attainment": 0.95}))
    a, ok = _up("--plan", str(path))
    assert ok and (a.prefill, a.decode, a.colocated) == (2, 1, False)
    assert a.max_num_batched_tokens == 512  # the chunk it was simulated with
    assert "chunk 512" in capsys.readouterr().err
    unmet = {"layout": "colocated:4", "met": False, "asked_rate_req_s": 100.0, "max_rate_req_s": 30.5}
    path.write_text(json.dumps(unmet))
    a, ok = _up("--plan", str(path))
    assert ok and (a.prefill, a.decode, a.colocated) == (0, 4, True)
    assert "does not meet its rate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="names no layout"):
        plan_layout({"slo_attainment": 1.0})
    with pytest.raises(ValueError, match="positive number of tokens"):
        plan_layout({"layout": "1p1d", "chunk": "big"})


@pytest.mark.parametrize(
    "args",
    [("--layout", "1p1d", "--prefill", "2"), ("--layout", "1p1d", "--colocated"), ("--layout", "3x1"),
     ("--plan", "/nonexistent/plan.json")],
)  # fmt: skip
def test_conflicts_and_bad_layouts_are_refused(args, capsys):
    _, ok = _up(*args)
    assert not ok and capsys.readouterr().err.startswith("error:")
