"""The emulated runner (issue 30 part 5): which cost a step pays, and its stand-in tokens. In tests/model: the runner returns the model runner's outputs, whose module imports torch."""

from baton.common.engine.emulated_runner import EmulatedModelRunner, FakeVocab, StepCosts, step_ms
from baton.common.engine.request import Request
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput

# Distinct figures, so that each sum below has one reading: prefill 100 + tokens, decode 10 + batch
# + context / 1000, the mixed step's fixed cost once (the smaller, 10).
COSTS = StepCosts(
    prefill_ms=lambda pieces: 100.0 + sum(t for t, _ in pieces),
    decode_ms=lambda batch, context: 10.0 + batch + context / 1000.0 if batch else 0.0,
    shared_ms=10.0,
)


def _row(rid: str, start: int, n: int, sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(range(n)), start, (0, 1, 2, 3), sample)


def test_decode_only_step_costs_the_decode_model_over_batch_and_context():
    sched = SchedulerOutput((_row("a", 99, 1), _row("b", 899, 1)))
    assert step_ms(sched, COSTS) == 10.0 + 2 + 1000 / 1000.0


def test_prefill_only_step_costs_the_prefill_model_over_its_pieces():
    sched = SchedulerOutput((_row("a", 0, 64, sample=False), _row("b", 32, 16)))
    assert step_ms(sched, COSTS) == 100.0 + 80


def test_mixed_step_pays_the_fixed_cost_once():
    sched = SchedulerOutput((_row("d", 499, 1), _row("p", 0, 20)))
    assert step_ms(sched, COSTS) == (100.0 + 20) + (10.0 + 1 + 0.5) - 10.0


def test_fake_tokens_are_deterministic_and_avoid_eos_and_stop_ids():
    vocab = FakeVocab(17, 49152, frozenset([2]))
    again = FakeVocab(17, 49152, frozenset([2]))
    seq = [vocab.token("req-1", i) for i in range(200)]
    assert seq == [again.token("req-1", i) for i in range(200)]
    assert seq != [vocab.token("req-2", i) for i in range(200)]
    assert all(17 <= t < 49152 for t in seq)
    tiny = FakeVocab(10, 13, frozenset([11]))  # ids 10 and 12 only; 12 is a stop id below
    assert {tiny.token("r", i, also_avoid=(12,)) for i in range(50)} == {10}


def test_runner_sleeps_the_modelled_time_and_samples_only_rows_that_sample():
    slept: list[float] = []
    now = [0.0]
    runner = EmulatedModelRunner(COSTS, FakeVocab(17, 1000), sleep=slept.append, clock=lambda: now[0])
    reqs = {
        rid: Request(
            rid, [5] * 40, SamplingParams(max_tokens=4, logprobs=1 if rid == "b" else None), frozenset()
        )
        for rid in ("a", "b", "c")
    }
    sched = SchedulerOutput((_row("a", 39, 1), _row("b", 0, 40), _row("c", 0, 16, sample=False)))
    out = runner.execute(sched, reqs, {})
    assert sorted(out.sampled) == ["a", "b"]
    assert out.sampled["a"].token_id == FakeVocab(17, 1000).token("a", 40)
    assert out.sampled["a"].logprob is None and out.sampled["b"].logprob == 0.0
    assert out.sampled["b"].top_logprobs.token_ids == (out.sampled["b"].token_id,)
    assert slept == [step_ms(sched, COSTS) / 1000.0]
    assert runner.modelled_seconds_total == slept[0]
