"""Engine flags reach the engine's config, and ``baton up`` hands them on to its workers."""

from __future__ import annotations

import pytest

from baton.cli.main import build_parser
from baton.common.engine.config_flags import engine_flags, engine_kwargs


def test_max_model_len_reaches_workers_directly_and_through_baton_up():
    parser = build_parser()
    decode = parser.parse_args(["decode", "--max-model-len", "512"])
    assert engine_kwargs(decode)["max_model_len"] == 512
    assert engine_kwargs(parser.parse_args(["decode"]))["max_model_len"] is None  # the model's own
    up = parser.parse_args(["up", "--max-model-len", "512"])
    flags = engine_flags(up)
    assert flags[flags.index("--max-model-len") + 1] == "512"
    handed_on = parser.parse_args(["decode", *flags])
    assert engine_kwargs(handed_on)["max_model_len"] == 512
    assert "--max-model-len" not in engine_flags(parser.parse_args(["up"]))


def test_workers_advertise_the_address_others_reach_them_at():
    import socket

    from baton.services.worker_base import advertised

    parser = build_parser()
    from baton.services.worker_cli import worker_kwargs

    local = worker_kwargs(parser.parse_args(["decode"]))
    assert (local["host"], local["advertise_host"], local["transfer"].host) == ("127.0.0.1", "", "127.0.0.1")
    pod = worker_kwargs(parser.parse_args(["prefill", "--host", "0.0.0.0", "--advertise-host", "10.1.2.3"]))
    assert (pod["host"], pod["transfer"].host) == ("0.0.0.0", "10.1.2.3")  # bind all, name the pod's
    assert advertised("127.0.0.1") == "127.0.0.1"
    assert advertised("0.0.0.0", "decode-1") == "decode-1"
    assert advertised("0.0.0.0") == socket.gethostbyname(socket.gethostname())  # a container's own


def test_device_reaches_workers_and_an_absent_gpu_is_a_clear_error():
    import torch

    from baton.common.engine.config import EngineConfig
    from baton.common.parallel.engine_factory import create_engine

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["decode"]))["device"] == "cpu"
    assert "--device" not in engine_flags(parser.parse_args(["up"]))
    flags = engine_flags(parser.parse_args(["up", "--device", "cuda"]))
    assert engine_kwargs(parser.parse_args(["prefill", *flags]))["device"] == "cuda"
    if not torch.cuda.is_available():  # refused before any weight is read
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            create_engine(EngineConfig(device="cuda"))


def test_no_jump_forward_reaches_workers_directly_and_through_baton_up():
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["decode"]))["jump_forward"] is True
    offline = parser.parse_args(["generate", "--prompt", "x", "--no-jump-forward"])
    assert engine_kwargs(offline)["jump_forward"] is False
    assert "--no-jump-forward" not in engine_flags(parser.parse_args(["up"]))
    flags = engine_flags(parser.parse_args(["up", "--no-jump-forward"]))
    assert "--no-jump-forward" in flags
    assert engine_kwargs(parser.parse_args(["decode", *flags]))["jump_forward"] is False


def test_baton_up_gives_each_role_its_parallel_degrees(monkeypatch):
    """``--prefill-tp/-pp`` and ``--decode-tp/-pp`` reach the config ``baton up`` runs (each
    defaulting to ``--tensor-parallel-size`` / ``--pipeline-parallel-size``), and each worker's
    command line ends with its own degrees, after (so over) the engine flags handed to every one."""
    from baton.cli import main as cli
    from baton.services import up

    seen: list = []
    monkeypatch.setattr(up, "run_cluster", lambda cfg: seen.append(cfg) or 0)
    assert cli.main(["up", "-pp", "2", "--decode-pp", "1", "--decode-tp", "2", "--prefill", "1"]) == 0
    assert cli.main(["up", "--prefill-pp", "2", "--prefill", "1"]) == 0
    degrees = [(c.prefill_tp, c.prefill_pp, c.decode_tp, c.decode_pp) for c in seen]
    assert degrees == [(1, 2, 2, 1), (1, 2, 1, 1)]
    parser = build_parser()
    for cfg in seen:
        for role, tp, pp in (
            ("prefill", cfg.prefill_tp, cfg.prefill_pp),
            ("decode", cfg.decode_tp, cfg.decode_pp),
        ):
            a = parser.parse_args([role, *cfg.engine_args, *up._degree_flags(cfg, role)])
            assert (a.tensor_parallel_size, a.pipeline_parallel_size) == (tp, pp), (role, cfg)


def test_parallel_workers_move_kv_over_ucx_only(capsys):
    from baton.cli import main as cli

    for argv in (
        ["prefill", "-pp", "2", "--kv-transport", "nccl"],
        ["decode", "--pipeline-parallel-size", "2", "--kv-transport", "nccl"],
        ["up", "--decode-pp", "2", "--kv-transport", "nccl"],
        ["prefill", "-tp", "2", "--kv-transport", "nccl"],
    ):
        assert cli.main(argv) == 2, argv
        assert "ucx only" in capsys.readouterr().err


def test_gpu_memory_utilization_reaches_workers_and_is_refused_off_a_gpu(capsys):
    from baton.cli import main as cli

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["decode"]))["gpu_memory_utilization"] is None  # off
    assert "--gpu-memory-utilization" not in engine_flags(parser.parse_args(["up"]))
    flags = engine_flags(parser.parse_args(["up", "--device", "cuda", "--gpu-memory-utilization", "0.9"]))
    assert engine_kwargs(parser.parse_args(["prefill", *flags]))["gpu_memory_utilization"] == 0.9
    # refused before any worker starts or any weight is read
    assert cli.main(["up", "--gpu-memory-utilization", "0.9"]) == 2
    assert "on device 'cpu' give kv_cache_gib" in capsys.readouterr().err
    assert cli.main(["decode", "--device", "cuda", "--gpu-memory-utilization", "1.5"]) == 2
    assert "must be in (0, 1], got 1.5" in capsys.readouterr().err
