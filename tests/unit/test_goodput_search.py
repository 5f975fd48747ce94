"""``baton bench goodput``: a rate's verdict from a client's summary, and the rate search's answer."""

from __future__ import annotations

import pytest

from baton.bench.goodput import RateResult, SearchConfig, highest_passing, rate_result, vllm_command

CFG = SearchConfig(base_url="http://127.0.0.1:1", rates=(0.5, 1.0), num_prompts=40)


def _summary(good: int, duration: float = 100.0) -> dict:
    return {
        "completed": 40,
        "duration": duration,
        "request_goodput": good / duration,  # both clients report good requests per second
        "request_throughput": 40 / duration,
        "median_ttft_ms": 200.0,
        "median_tpot_ms": 40.0,
        "p90_tpot_ms": 55.0,
    }


def test_a_rate_passes_with_nine_in_ten_within_the_slos():
    assert rate_result(0.5, 3, CFG, _summary(36)).passed  # 90%
    r = rate_result(0.5, 3, CFG, _summary(35, duration=87.5))
    assert (r.good, r.share_good, r.passed) == (35, 35 / 40, False)


def _r(rate: float, passed: bool) -> RateResult:
    return RateResult(rate, 0, 40, 40, 40 if passed else 0, 1.0 if passed else 0.0, passed, 0, 0, 0, 0)


def test_goodput_is_the_highest_rate_before_the_first_failure():
    assert highest_passing([_r(0.25, True), _r(0.5, True), _r(0.75, False)]) == 0.5
    assert highest_passing([_r(0.5, True), _r(0.25, True)]) == 0.5  # order of the runs does not matter
    assert highest_passing([_r(0.25, False), _r(0.5, True)]) == 0.0  # a lucky rate after a failure: no
    assert highest_passing([]) == 0.0


def test_the_vllm_client_is_asked_for_the_same_workload():
    cmd = vllm_command(
        SearchConfig(base_url="http://h:1", rates=(1,), tokenizer="/t"), 0.75, 5, "/r", "x.json"
    )
    joined = " ".join(cmd)
    for part in ("--random-input-len 256", "--random-output-len 256", "--num-prompts 40", "--request-rate 0.75",
                 "--ignore-eos", "--seed 5", "--goodput ttft:1500 tpot:60", "--base-url http://h:1"):  # fmt: skip
        assert part in joined, part
    with pytest.raises(ValueError, match="tokenizer"):
        vllm_command(CFG, 1.0, 0, "/r", "x.json")
