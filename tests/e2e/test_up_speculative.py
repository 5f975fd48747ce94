"""``baton up --speculative ngram`` as a user runs it: a prefill worker and a speculating decode
worker in real processes, KV over real UCX, driven by the official ``openai`` client. A greedy
completion that copies its own prompt gets n-gram proposals accepted, and its tokens are still the
in-process engine's without speculation (fp32); the prompt was computed by the prefill worker and
its KV reached the decode worker, which computed none of it."""

from __future__ import annotations

import re

import httpx
import pytest

from baton.common.llm import SamplingParams
from tests.e2e.up_process import start_up, stop_up

# Serial, as test_up_tp: a whole cluster of model processes; beside another module's cluster a
# starved worker misses the gateway's 2 s keepalive.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

TEXT = "The market opens at dawn on Saturdays, and farmers bring apples, cheese and wool from the hills."
# SmolLM2 fp32 continues with the rest of the sentence, which n-grams find in the prompt. 53 tokens:
# over baton up's --remote-prefill-threshold (32), so the prefill worker computes it.
PROMPT = f"Repeat this sentence exactly: {TEXT}\n{TEXT}\nThe market"
MAX_TOKENS = 24
SPEC = "baton:spec_decode_num_"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-spec")
    args = ["--dtype", "float32", "--kv-cache-gib", "0.25", "--max-model-len", "1024", "--prefill", "1"]
    # Not adaptive: the step-cost model may turn proposals off on a slow machine, and the counters
    # checked here would then depend on timing. The tokens are the same either way.
    port, proc = start_up([*args, "--speculative", "ngram", "--no-adaptive-speculation"], logs)
    yield port
    stop_up(proc)


def _decode_metrics(port: int) -> str:
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    (decode,) = [w for w in workers if w["role"] == "decode"]
    return httpx.get(decode["metrics_url"], timeout=10).text


def _samples(body: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body, re.M)]


def test_speculation_keeps_the_greedy_tokens_of_the_plain_engine(cluster, llm_fp32):
    import openai

    port = cluster
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    before = _decode_metrics(port)
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    ).choices[0]
    after = _decode_metrics(port)

    ref = llm_fp32.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert got.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert got.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert got.text == ref.outputs[0].text
    assert got.finish_reason == ref.outputs[0].finish_reason

    def delta(name: str) -> float:
        # Before, a labelled counter may have no series yet (accepted_tokens_per_pos: no position).
        assert _samples(after, name), f"{name} not in the decode worker's /metrics"
        return sum(_samples(after, name)) - sum(_samples(before, name))

    # The decode worker speculated on this request, and some of its proposals were right.
    drafted, accepted = delta(f"{SPEC}draft_tokens_total"), delta(f"{SPEC}accepted_tokens_total")
    assert delta(f"{SPEC}drafts_total") > 0
    assert 0 < accepted <= drafted, (accepted, drafted)
    assert delta(f"{SPEC}accepted_tokens_per_pos_total") == accepted
    # The prompt was computed by the prefill worker; its KV crossed to the decode worker.
    assert delta("baton:kv_received_bytes_total") > 0, "no KV reached the decode worker"
    assert delta("baton:prompt_tokens_computed_total") == 0, "the decode worker computed the prompt"
