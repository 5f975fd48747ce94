"""Each backend inside one process: several senders into one receiver, and argument checking."""

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

BACKENDS = ["ucx", "nccl"]


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
