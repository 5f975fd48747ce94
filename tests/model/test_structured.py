"""Structured outputs on the real SmolLM2 weights (fp32, the offline engine): every output of a set
of JSON schemas parses and validates; regex and choice outputs match; jump-forward appends forced
tokens in multi-token steps (fewer forward steps) and gives the same JSON values as sampling every
token; a request resumed mid-JSON (migration) replays its grammar and still ends valid."""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import pytest

from baton.common.engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
            "population_millions": {"type": "number"},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "population_millions", "is_capital"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 12},
                    "last": {"type": "string", "maxLength": 12},
                },
                "required": ["first", "last"],
            },
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["title", "author", "year"],
    },
]
QUESTIONS = [
    "Describe a person as JSON with a name and an age.",
    "Describe the capital of France as JSON.",
    "Describe a famous book as JSON.",
]


def _chat_ids(llm, question: str) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


@contextlib.contextmanager
def jump_forward(llm, on: bool):
    """The shared engine with jump-forward on or off, restored after."""
    s = llm.engine.structured
    before = s.jump_forward
    s.jump_forward = on
    try:
        yield s.stats
    finally:
        s.jump_forward = before


def _json_params(schema, max_tokens=64, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema), **kw
    )


@pytest.fixture(scope="module")
def json_runs(llm_fp32):
    """The schemas' greedy outputs with jump-forward on and off, and each run's token counts."""
    prompts = [{"prompt_token_ids": _chat_ids(llm_fp32, q)} for q in QUESTIONS]
    params = [_json_params(s) for s in SCHEMAS]
    runs = {}
    for on in (True, False):
        with jump_forward(llm_fp32, on) as stats:
            sampled, forced = stats.sampled_tokens, stats.forced_tokens
            outs = llm_fp32.generate(prompts, params)
            runs[on] = outs, stats.sampled_tokens - sampled, stats.forced_tokens - forced
    return runs


@pytest.mark.parametrize("on", [True, False], ids=["jump", "no-jump"])
def test_every_output_parses_and_validates(json_runs, on):
    outs, _, _ = json_runs[on]
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_jump_forward_takes_fewer_forward_steps(json_runs):
    outs_on, sampled_on, forced_on = json_runs[True]
    outs_off, sampled_off, forced_off = json_runs[False]
    assert forced_off == 0 and forced_on > 0
    # Every output token is either sampled (one forward step of its request) or forced.
    assert sampled_on + forced_on == sum(len(o.outputs[0].token_ids) for o in outs_on)
    assert sampled_off == sum(len(o.outputs[0].token_ids) for o in outs_off)
    steps_per_token = sampled_on / (sampled_on + forced_on)
    assert steps_per_token < 0.8, steps_per_token


def test_jump_forward_keeps_the_json_values(json_runs):
    """The forced tokens are the tokenizer's own encoding of the grammar's only continuation, so
    the values the model chooses are the same with jump-forward on and off (greedy)."""
    same = [
        json.loads(a.outputs[0].text) == json.loads(b.outputs[0].text)
        for a, b in zip(json_runs[True][0], json_runs[False][0])
    ]
    assert sum(same) >= len(same) - 1, [
        (a.outputs[0].text, b.outputs[0].text) for a, b in zip(json_runs[True][0], json_runs[False][0])
    ]


def test_forced_tokens_are_canonical(llm_fp32, json_runs):
    """Jumped tokens are what the tokenizer makes of their text: re-encoding an output's text
    gives no more tokens than the output has (a token-by-token grammar path often has more)."""
    tok = llm_fp32.get_tokenizer()
    for out in json_runs[True][0]:
        c = out.outputs[0]
        assert len(tok.encode(c.text, add_special_tokens=False)) <= len(c.token_ids)


def test_regex_choice_grammar_and_json_object(llm_fp32):
    """One batch: greedy and sampled rows, masked and free rows side by side."""
    tok = llm_fp32.get_tokenizer()
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    cases = [
        ("What is a phone number I can call?", StructuredOutputsParams(regex=regex), 1.0),
        ("Is the sky blue?", StructuredOutputsParams(choice=("yes", "no", "maybe")), 1.0),
        ("Is the sky blue?", StructuredOutputsParams(grammar=grammar), 0.0),
        ("What is 2+2? Reply in JSON.", StructuredOutputsParams(json_object=True), 0.0),
        ("Is the sky blue?", None, 0.0),
    ]
    prompts = [{"prompt_token_ids": _chat_ids(llm_fp32, q)} for q, _, _ in cases]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=24, structured_outputs=s) for _, s, t in cases]
    phone, choice, said, obj, free = (o.outputs[0] for o in llm_fp32.generate(prompts, params))
    assert re.fullmatch(regex, phone.text), phone.text
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    assert said.text in ("The answer is yes.", "The answer is no.")
    assert isinstance(json.loads(obj.text), dict), obj.text
    reference = llm_fp32.generate(prompts[-1], params[-1])[0].outputs[0]
    assert free.text == reference.text  # a row without a grammar is left alone
    assert tok.decode(said.token_ids, skip_special_tokens=True) == said.text


def test_a_bad_spec_is_refused_before_any_work(llm_fp32):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objekt"}))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm_fp32.engine.validate_request([1, 2, 3], bad)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_a_request_resumed_mid_json_replays_its_grammar(llm_fp32, json_runs):
    """Migration: the tokens another worker sent become the output so far; the grammar state is
    replayed from them, so the rest is constrained where it left off and the JSON is valid."""
    engine = llm_fp32.engine
    schema = SCHEMAS[2]
    ids = _chat_ids(llm_fp32, QUESTIONS[2])
    full = json_runs[True][0][2].outputs[0]
    half = full.token_ids[: len(full.token_ids) // 2]
    assert not _parses(llm_fp32.get_tokenizer().decode(half))
    engine.add_request("resumed-json", ids, _json_params(schema), resume_token_ids=half)
    out = _run_to_end(engine, "resumed-json")
    assert out.token_ids[: len(half)] == half
    jsonschema.validate(json.loads(out.text), schema)
    assert out.text == full.text  # greedy: it goes on exactly as the first worker would have
    # Tokens that break the grammar cannot be resumed.
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request("resumed-bad", ids, _json_params(schema), resume_token_ids=[29])


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _run_to_end(engine, request_id: str):
    for _ in range(500):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0]
    raise AssertionError(f"{request_id} did not finish in 500 steps")


COPIES = [
    {"name": "Ada Lovelace", "age": 36},
    {"title": "The Hobbit", "author": {"first": "John", "last": "Tolkien"}, "year": 1937},
]
COPY_SCHEMAS = [SCHEMAS[0], SCHEMAS[2]]


def test_speculation_and_jump_forward_together_keep_greedy_structured_output(llm_fp32):
    """A prompt-grounded JSON task (copy the given object): jump-forward appends the keys the
    schema forces, n-gram proposals copy the values from the prompt and are verified under the
    grammar; the output is token for token the one without speculation, and validates."""
    from baton.common.engine.config import EngineConfig
    from baton.common.engine.llm_engine import LLMEngine

    base = llm_fp32.engine
    config = EngineConfig(
        dtype="float32", kv_cache_gib=0.1, max_model_len=2048, speculative="ngram", adaptive_speculation=False
    )
    spec = LLMEngine(config, base.model, base.tokenizer, base.eos_token_ids)
    questions = [f"Copy this JSON object exactly:\n\n{json.dumps(c, separators=(',', ':'))}" for c in COPIES]
    ids = [_chat_ids(llm_fp32, q) for q in questions]
    outs = llm_fp32.generate([{"prompt_token_ids": i} for i in ids], [_json_params(s) for s in COPY_SCHEMAS])
    want = [o.outputs[0] for o in outs]
    for n, (prompt, schema) in enumerate(zip(ids, COPY_SCHEMAS)):
        spec.add_request(str(n), prompt, _json_params(schema))
    got = {}
    for _ in range(500):
        if not spec.has_unfinished_requests():
            break
        got |= {o.request_id: o.outputs[0] for o in spec.step()}
    assert not spec.has_unfinished_requests()
    for n, (w, schema) in enumerate(zip(want, COPY_SCHEMAS)):
        assert got[str(n)].token_ids == w.token_ids, (got[str(n)].text, w.text)
        assert got[str(n)].finish_reason == "stop"
        jsonschema.validate(json.loads(w.text), schema)
    assert spec.speculator.stats.num_accepted_tokens >= 4, spec.speculator.stats
    assert spec.structured.stats.forced_tokens > 0  # jump-forward took its turns too


def test_a_requests_own_stop_token_may_end_its_grammar(llm_fp32):
    """xgrammar ends a grammar on the engine's EOS only, unless told otherwise: a request's
    ``stop_token_ids`` must be allowed where the grammar may end (vLLM passes them as
    ``override_stop_tokens``), and one that is allowed ends the request there, as without a grammar.
    After "The answer is yes" the model wants ".", which this grammar does not produce itself."""
    tok = llm_fp32.get_tokenizer()
    (period,) = tok.encode(".", add_special_tokens=False)
    grammar = StructuredOutputsParams(grammar='root ::= "The answer is " ("yes" | "no")')
    prompt = {"prompt_token_ids": _chat_ids(llm_fp32, "Is the sky blue? Answer in one sentence.")}
    plain, own = llm_fp32.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=grammar),
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=grammar, stop_token_ids=[period]),
        ],
    )
    plain, own = plain.outputs[0], own.outputs[0]
    assert plain.text in ("The answer is yes", "The answer is no"), plain.text
    assert plain.stop_reason is None and plain.token_ids[-1] in tok.all_special_ids  # EOS: the only way out
    assert own.finish_reason == "stop" and own.stop_reason == period, (own.stop_reason, own.text)
    assert own.token_ids[-1] == period and own.text.startswith(plain.text)
