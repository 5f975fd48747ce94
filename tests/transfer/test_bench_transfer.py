"""``baton bench transfer`` (W5) end to end at small sizes: real sender and receiver processes, every
transport beside TCP and memcpy, bytes checked on the receiver, children gone afterwards."""

from __future__ import annotations

import json
import os

import pytest

from baton.bench import transfer as bench_transfer
from baton.bench.transfer_peers import KVGeometry, Peer, PeerError, PeerSpec

pytestmark = pytest.mark.slow
LINKS = {"ucx", "nccl", "tcp", "memcpy"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("w5") / "w5.json"
    # 40 tokens is not a whole number of blocks; the prefill times are given, not measured.
    argv = ["--tokens", "40,64", "--repeats", "2", "--warmup", "1"]
    argv += ["--prefill-seconds", "40=0.5,64=0.8", "--timeout", "20", "--output-json", str(out)]
    assert bench_transfer.main(argv) == 0
    return json.loads(out.read_text())


def test_every_link_moves_the_blocks_of_the_tokens(result):
    geometry = result["geometry"]
    assert geometry["block_shape"] == [30, 2, 3, 16, 64]  # SmolLM2's block, as the engine lays it out
    assert geometry["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    for size, tokens in zip(result["sizes"], (40, 64)):
        rounded_up = -(-tokens // 16) * 16
        assert size["tokens"] == tokens
        assert size["bytes"] == rounded_up * geometry["bytes_per_token"]
        assert set(size["links"]) == LINKS
        for link, stats in size["links"].items():
            assert stats["bytes"] == size["bytes"], link
            assert stats["gbps"] > 0 and len(stats["samples_s"]) == 2, link
            assert stats["gbps"] == pytest.approx(size["bytes"] / stats["seconds"] / 1e9)


def test_received_blocks_equal_the_sent_ones(result):
    for size in result["sizes"]:
        assert all(stats["verified"] for stats in size["links"].values()), size


def test_ratios_to_tcp_and_to_the_given_prefill(result):
    for size, prefill in zip(result["sizes"], (0.5, 0.8)):
        assert size["prefill_seconds"] == prefill and size["prefill_source"] == "given"
        tcp = size["links"]["tcp"]["gbps"]
        for stats in size["links"].values():
            assert stats["vs_tcp"] == pytest.approx(stats["gbps"] / tcp)
            assert stats["fraction_of_prefill"] == pytest.approx(stats["seconds"] / prefill)


def test_peer_processes_are_gone(result):
    pids = result["peer_pids"]
    assert len(pids) == 2 and os.getpid() not in pids
    assert not any(_alive(pid) for pid in pids)


def test_prefill_beyond_the_context_is_not_measured():
    geometry = KVGeometry("m", 30, 3, 64, 16, "bfloat16", max_model_len=8192)
    config = bench_transfer.TransferBenchConfig(tokens=(8192, 16384))
    prefill = bench_transfer.measure_prefill(config, geometry)  # loads no model: nothing fits
    for tokens in (8192, 16384):
        assert prefill[tokens]["seconds"] is None
        assert "max_model_len 8192" in prefill[tokens]["source"]


def test_a_failing_or_dead_peer_raises_instead_of_hanging():
    geometry = KVGeometry("m", 2, 1, 8, 4, "float32", max_model_len=64)
    peer = Peer("receiver", PeerSpec(geometry, num_blocks=4, transports=("tcp",), timeout_s=5.0, seed=0))
    peer.start()
    try:
        with pytest.raises(PeerError, match="KeyError"):  # a command that fails in the child
            peer.call("arm", "ucx", "t", 1, timeout_s=60)
        assert peer.call("open", timeout_s=60)["tcp"]["port"] > 0  # ... and the peer still serves
        peer.process.kill()
        with pytest.raises(PeerError, match="exited"):
            peer.call("checksum", 1, timeout_s=60)
    finally:
        peer.stop(5.0)
    assert not peer.process.is_alive()
