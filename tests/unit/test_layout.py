"""``baton up``'s automatic layout (``services/layout.py``): what it decides from the machine's
figures, and that every flag still wins."""

from __future__ import annotations

import pytest

from baton.services.layout import LayoutRequest, plan, probe_threads

AMX = {  # shaped like gemm_probe.GemmProbe, figures as measured on a 2-core Xeon with AMX
    "cpu": "Intel(R) Xeon(R) Processor",
    "dtype": "bfloat16",
    "request_ms": {"bfloat16": 5397.0, "float32": 16905.0},
    "decode_step_ms_by_threads": {"1": 44.5, "2": 20.8},
}
FLAT = {**AMX, "decode_step_ms_by_threads": {"1": 22.0, "2": 20.0}}  # decode gains nothing from a core


def test_two_cores_where_decoding_needs_both_run_colocated():
    got = plan([0, 1], LayoutRequest(), AMX)
    assert (got.prefill, got.decode, got.cpus, got.dtype) == (0, 1, None, "bfloat16")
    assert "2.14x slower" in got.describe() and "colocated" in got.describe()


def test_two_cores_where_one_decodes_as_fast_split_one_each():
    got = plan([0, 1], LayoutRequest(), FLAT)
    assert (got.prefill, got.decode, got.cpus) == (1, 1, "0|1")
    assert "1.10x slower" in got.describe()


def test_more_cores_give_prefill_a_quarter():
    probe = {**FLAT, "decode_step_ms_by_threads": {"6": 11.0, "8": 10.0}}
    assert probe_threads(8) == [6, 8]
    got = plan(list(range(8)), LayoutRequest(), probe)
    assert (got.prefill, got.cpus) == (1, "0,1|2,3,4,5,6,7")
    assert plan([0], LayoutRequest(dtype="float32"), None).prefill == 0  # one core: nothing to split


def test_a_cpu_without_bf16_instructions_gets_fp32_and_says_why():
    probe = {**FLAT, "dtype": "float32", "request_ms": {"float32": 25227.0}}
    got = plan([0, 1], LayoutRequest(), probe)
    assert got.dtype == "float32" and "the only dtype this CPU multiplies natively" in got.describe()


def test_a_cpu_that_multiplies_bf16_gets_bf16_and_says_why():
    probe = {**FLAT, "request_ms": {"bfloat16": 5397.0}}  # the flags decided: bf16 alone timed
    got = plan([0, 1], LayoutRequest(), probe)
    assert (
        got.dtype == "bfloat16"
        and "this CPU multiplies bf16 natively, or Baton's GEMM widens it" in got.describe()
    )


def test_flags_win_and_need_no_probe():
    req = LayoutRequest(prefill=2, decode=1, dtype="float32", cpus="none")
    got = plan([0, 1], req, None)
    assert (got.prefill, got.decode, got.cpus, got.dtype) == (2, 1, None, "float32")
    assert plan([0, 1], LayoutRequest(colocated=True, dtype="bfloat16"), None).prefill == 0
    assert plan([0, 1], LayoutRequest(prefill=1, dtype="bfloat16"), None).cpus == "0|1"
    assert plan([0, 1], LayoutRequest(prefill=2, dtype="bfloat16"), None).cpus == "auto"  # 3 workers, 2 cores
    assert plan([0, 1], LayoutRequest(prefill=1, cpus="1|0", dtype="bfloat16"), None).cpus == "1|0"
    with pytest.raises(ValueError, match="probe"):
        plan([0, 1], LayoutRequest(), None)
