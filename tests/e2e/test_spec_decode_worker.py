"""A decode worker with n-gram speculation over real gRPC streams the tokens of the offline engine
without it, and its /metrics carries the spec_decode counters. The real SmolLM2 in fp32: a random
model never repeats itself, so n-grams would propose nothing to verify."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
import pytest

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.llm import SamplingParams
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24)
TEXT = "The market opens at dawn on Saturdays, and farmers bring apples, cheese and wool from the hills."


@pytest.fixture(scope="module")
def worker():
    """One speculating worker for the module, on its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(
        dtype="float32", kv_cache_gib=0.1, max_model_len=1024, speculative="ngram", adaptive_speculation=False
    )
    w = DecodeWorker(DecodeWorkerConfig(engine=engine))
    asyncio.run_coroutine_threadsafe(w.start(), loop).result(timeout=300)
    yield w
    asyncio.run_coroutine_threadsafe(w.stop(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_speculating_worker_streams_the_tokens_of_the_plain_engine(worker, llm_fp32):
    tok = llm_fp32.get_tokenizer()
    tasks = ["Repeat this sentence exactly:", "Rewrite this sentence with 'Saturdays' as 'Sundays':"]
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        stub = baton_pb2_grpc.DecodeStub(channel)
        for i, task in enumerate(tasks):
            messages = [{"role": "user", "content": f"{task}\n\n{TEXT}"}]
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(prompt, add_special_tokens=False)
            request = baton_pb2.GenerateRequest(
                request_id=f"r{i}", prompt_token_ids=ids, params=params_to_proto(GREEDY)
            )
            chunks = list(stub.Generate(request, timeout=120))
            ref = llm_fp32.generate([ids], GREEDY)[0].outputs[0]
            assert [t for c in chunks for t in c.token_ids] == ref.token_ids
            assert "".join(c.text for c in chunks) == ref.text
            assert chunks[-1].finish_reason == ref.finish_reason
            # Fewer chunks than tokens: steps that verified proposals sent several tokens at once.
            assert len([c for c in chunks if c.token_ids]) < len(ref.token_ids)
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    drafted = _metric(text, "baton:spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "baton:spec_decode_num_accepted_tokens_total")
    assert _metric(text, "baton:spec_decode_num_drafts_total") > 0
    assert 0 < accepted <= drafted
    assert _metric(text, "baton:spec_decode_num_accepted_tokens_per_pos_total") == accepted
