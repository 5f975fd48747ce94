"""Each backend inside one process (ucx, and the "nccl" transport as it runs on CPU caches: gloo):
several senders into one receiver, and argument checking."""

from __future__ import annotations

import pytest
import torch

from baton.common.transfer import (
    TransferConfig,
    TransferDescriptor,
    TransferError,
    make_receiver,
    make_sender,
)
from tests.transfer.backends import CPU_BACKENDS as BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_senders_fill_one_receiver(backend):
    # A decode worker takes KV from two prefill workers at once.
    config = TransferConfig(backend=backend, timeout_s=10.0)
    cache = torch.zeros(32, 4, 8)
    sources = [torch.full((32, 4, 8), float(i + 1)) for i in range(2)]
    with make_receiver(config, cache) as receiver:
        descriptor = TransferDescriptor.from_dict(receiver.start().to_dict())
        handles = [receiver.expect("a", [0, 1, 2, 9]), receiver.expect("b", [20, 21])]
        senders = [make_sender(config, src) for src in sources]
        try:
            for s in senders:
                s.connect(descriptor)
            if backend == "nccl":  # the test id says gloo: so does the pair group it made
                assert [s._group.name() for s in senders] == ["gloo", "gloo"]
            senders[0].send("a", [5, 6], [0, 1])
            senders[1].send("b", [7, 8], [21, 20])
            senders[0].send("a", [7, 3], [2, 9])
            for s, tid in zip(senders, "ab"):
                s.finish(tid).wait(10)
            for h in handles:
                h.wait(10)
        finally:
            for s in senders:
                s.close()
        assert handles[0].nbytes == 4 * 4 * 8 * 4
        assert receiver.stats().transfers_ok == 2
    assert torch.equal(cache[[0, 1, 2, 9]], torch.ones(4, 4, 8))
    assert torch.equal(cache[[20, 21]], torch.full((2, 4, 8), 2.0))
    untouched = [i for i in range(32) if i not in (0, 1, 2, 9, 20, 21)]
    assert not cache[untouched].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scattered_blocks_with_a_header_longer_than_the_head(backend):
    # 600 one-block runs: the header (~4.7 KB of JSON) spills past the fixed-size head.
    config = TransferConfig(backend=backend, timeout_s=10.0)
    src = torch.arange(1200 * 4, dtype=torch.float32).view(1200, 4)
    dst = torch.zeros(1024, 4)
    src_ids, dst_ids = list(range(0, 1200, 2)), list(range(599, -1, -1))
    with make_receiver(config, dst) as receiver:
        descriptor = receiver.start()
        handle = receiver.expect("scattered", dst_ids)
        with make_sender(config, src) as sender:
            sender.connect(descriptor)
            sender.send("scattered", src_ids, dst_ids)
            sender.finish("scattered").wait(10)
        handle.wait(10)
    assert torch.equal(dst[dst_ids], src[src_ids])
    assert not dst[600:].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_sends_and_expects_raise(backend):
    config = TransferConfig(backend=backend)
    cache = torch.zeros(8, 2)
    sender = make_sender(config, cache)
    with pytest.raises(ValueError, match="out of range"):
        sender.send("t", [8], [0])
    with pytest.raises(ValueError, match="1 source blocks but 2"):
        sender.send("t", [1], [0, 1])
    with pytest.raises(TransferError, match="not connected"):
        sender.send("t", [1], [0]).wait(1)
    other = "nccl" if backend == "ucx" else "ucx"
    with pytest.raises(ValueError, match="descriptor is for backend"):
        sender.connect(TransferDescriptor(other))
    receiver = make_receiver(config, cache)
    with pytest.raises(ValueError, match="out of range"):
        receiver.expect("t", [8])
    with pytest.raises(ValueError, match="contiguous"):
        make_receiver(config, torch.zeros(4, 8).t()).start()


def test_a_receive_given_up_on_keeps_its_buffers_and_the_receiver_goes_on():
    # The sender stops after a message's head (a prefill host cut off): the receiver's posted payload
    # receives time out but stay posted in UCX, so their buffers must outlive them (freed, a late
    # payload was written into freed memory: the decode worker died of SIGSEGV in tests/hosts).
    quick = TransferConfig(backend="ucx", timeout_s=0.5)
    cache = torch.zeros(16, 4, 8)
    with make_receiver(quick, cache) as receiver:
        descriptor = receiver.start()
        given_up = receiver.expect("held", [0, 1])
        # After one block, the next message goes out as a head without its payload.
        held_config = TransferConfig(backend="ucx", timeout_s=0.5, fault_hold_payload_after_blocks=1)
        held = make_sender(held_config, torch.ones(16, 4, 8))
        try:
            held.connect(descriptor)
            held.send("held", [2], [0])
            held.send("held", [3], [1])
            with pytest.raises(TransferError):
                given_up.wait(10)
        finally:
            held.close()
        assert receiver.abandoned_receives >= 1
        # And the next transfer, from another sender, lands.
        src = torch.full((16, 4, 8), 3.0)
        with make_sender(TransferConfig(backend="ucx", timeout_s=10.0), src) as good:
            handle = receiver.expect("good", [5])
            good.connect(descriptor)
            good.send("good", [7], [5])
            good.finish("good").wait(10)
            handle.wait(10)
    assert torch.equal(cache[5], torch.full((4, 8), 3.0))
