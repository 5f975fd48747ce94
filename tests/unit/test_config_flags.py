"""Every engine option is declared once, on its ``EngineConfig`` field (common/engine/config.py),
and the command line is generated from it (common/engine/config_flags.py): the flags each engine
command takes, the config from the parsed flags, and the command line ``baton up`` hands a worker."""

from __future__ import annotations

import os
from dataclasses import fields, replace

from baton.cli.main import build_parser
from baton.common.engine.config import EngineConfig, flag_of
from baton.common.engine.config_flags import engine_flags, engine_kwargs

NOT_ON_THE_COMMAND_LINE = {"seed", "max_consecutive_failed_steps", "cascade_min_shared_blocks"}

# Every option off its default, in two configs (emulate runs no speculation and one process; a GPU
# memory fraction goes with one replica).
BUSY = EngineConfig(
    model="tiny.gguf",
    dtype="float32",
    device="cuda",
    block_size=32,
    kv_cache_gib=2.5,
    gpu_memory_utilization=0.5,
    kv_cache_dtype="int8",
    quantization="fp8",
    max_num_batched_tokens=512,
    max_num_seqs=8,
    max_model_len=1024,
    enable_prefix_caching=False,
    max_waiting_requests=10,
    max_waiting_tokens=1000,
    cascade="off",
    jump_forward=False,
    speculative="draft",
    num_speculative_tokens=3,
    ngram_min=1,
    ngram_max=5,
    draft_model="/models/draft",
    adaptive_speculation=False,
    tensor_parallel_size=2,
    enable_expert_parallel=True,
    pipeline_parallel_size=2,
)
EMULATED = EngineConfig(emulate="/profiles/p.json", data_parallel_size=2)


def _options() -> set[str]:
    return {f.name for f in fields(EngineConfig) if flag_of(f) is not None}


def test_every_field_is_an_option_of_every_engine_command_but_those_kept_off_it():
    assert _options() == {f.name for f in fields(EngineConfig)} - NOT_ON_THE_COMMAND_LINE
    parser = build_parser()
    for cmd in (["decode"], ["prefill"], ["up"]):
        assert set(engine_kwargs(parser.parse_args(cmd))) == _options(), cmd
    offline = [["generate", "--prompt", "x"], ["bench", "offline"], ["profile", "--quick", "--output", "p"]]
    for cmd in offline:  # no emulated engine offline
        assert set(engine_kwargs(parser.parse_args(cmd))) == _options() - {"emulate"}, cmd


def test_every_flag_and_alias_is_on_the_workers_command_line():
    parser = build_parser()
    for f in fields(EngineConfig):
        spec = flag_of(f)
        if spec is None:
            continue
        for name in (spec.flag(f.name), *spec.aliases):
            a = parser.parse_args(["decode", *_given(name, f.name)])
            assert getattr(a, f.name) != getattr(EngineConfig(), f.name), name


def _given(flag: str, field: str) -> list[str]:
    """``flag`` with a value off its field's default."""
    value = getattr(BUSY if getattr(BUSY, field) != getattr(EngineConfig(), field) else EMULATED, field)
    if isinstance(value, bool):
        return [flag]
    return [flag, str(value)]


def test_the_dtype_default_is_each_commands():
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).dtype == "bfloat16"
    assert parser.parse_args(["bench", "offline"]).dtype == "bfloat16"
    assert parser.parse_args(["decode"]).dtype == "auto"
    assert parser.parse_args(["up"]).dtype == "auto"


def test_a_config_survives_the_trip_to_a_child_process():
    for f in fields(EngineConfig):  # the two configs cover every option
        assert f.name in NOT_ON_THE_COMMAND_LINE or any(
            getattr(c, f.name) != getattr(EngineConfig(), f.name) for c in (BUSY, EMULATED)
        ), f.name
    for config in (BUSY, EMULATED):
        argv = engine_flags(config)
        assert "--dtype" not in argv  # baton up resolves it and gives each worker its own
        parser = build_parser()
        child = EngineConfig(**engine_kwargs(parser.parse_args(["decode", *argv])))
        assert child == replace(config, dtype="auto")
        # and through baton up's own flags, as `baton up` hands them on
        up = parser.parse_args(["up", "--dtype", config.dtype, *argv])
        assert engine_flags(up) == argv


def test_a_child_gets_only_what_differs_files_made_absolute_and_no_speculation_knob_alone():
    assert engine_flags(EngineConfig()) == []
    argv = engine_flags(EngineConfig(speculative="draft", draft_model="draft"))
    assert argv[argv.index("--draft-model") + 1] == os.path.abspath("draft")
    assert engine_flags(EngineConfig(num_speculative_tokens=7, ngram_max=6)) == []  # no speculation
    parser = build_parser()
    argv = engine_flags(parser.parse_args(["up", "--emulate", "p.json"]))
    assert argv == ["--emulate", os.path.abspath("p.json")]
