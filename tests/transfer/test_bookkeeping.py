"""The transport-independent pieces, in one process: wire format, runs, the receiver's table of
expected transfers, handles, config, and a package import that pulls in no torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from baton.common.transfer import TransferConfig, TransferDescriptor, TransferError, TransferHandle
from baton.common.transfer.base import all_of
from baton.common.transfer.bookkeeping import Counters, ExpectedTransfers, SendLedger
from baton.common.transfer.wire import (
    HEAD_BYTES,
    KIND_DATA,
    PREAMBLE_BYTES,
    Preamble,
    Run,
    check_block_ids,
    coalesce,
    decode_head,
    decode_header,
    decode_preamble,
    encode_head,
    encode_header,
    encode_preamble,
    plan_message,
)


# -- wire ----------------------------------------------------------------------------------------
def test_coalesce_joins_only_runs_consecutive_on_both_sides():
    runs = coalesce([4, 5, 6, 9, 10, 11, 2], [0, 1, 2, 7, 3, 4, 5])
    assert runs == [Run(4, 0, 3), Run(9, 7, 1), Run(10, 3, 2), Run(2, 5, 1)]


def test_coalesce_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        coalesce([1, 2, 3], [1, 2])


def test_check_block_ids_rejects_out_of_range_and_repeats():
    assert check_block_ids((3, 0, 7), 8, "x") == [3, 0, 7]
    with pytest.raises(ValueError, match="out of range"):
        check_block_ids([8], 8, "x")
    with pytest.raises(ValueError, match="repeat"):
        check_block_ids([1, 1], 8, "x")


def test_header_and_preamble_round_trip():
    runs = [Run(4, 10, 3), Run(0, 2, 1)]
    header = decode_header(encode_header("req-7", runs))
    assert header.transfer_id == "req-7"
    assert header.runs == ((10, 3), (2, 1))
    assert header.dst_block_ids() == [10, 11, 12, 2]
    raw = encode_preamble(Preamble(KIND_DATA, 0xABCD << 32 | 9, 123))
    assert len(raw) == PREAMBLE_BYTES
    assert decode_preamble(raw) == Preamble(KIND_DATA, 0xABCD << 32 | 9, 123)


def test_a_layer_slice_header_has_a_payload_per_block_and_a_head_slice_one_per_run():
    runs = [Run(4, 10, 3), Run(0, 2, 1)]
    heads = decode_header(encode_header("h", runs, heads=(2, 3)))
    assert (heads.heads, heads.layers, heads.pieces()) == ((2, 3), None, [(10, 3), (2, 1)])
    layers = decode_header(encode_header("l", runs, heads=(0, 2), layers=(15, 30)))
    assert (layers.heads, layers.layers) == ((0, 2), (15, 30))
    assert layers.pieces() == [(10, 1), (11, 1), (12, 1), (2, 1)]


def test_head_carries_a_short_header_whole_and_a_long_one_in_part():
    short = encode_header("s", [Run(0, 0, 4)])
    head, tail = encode_head(KIND_DATA, 7, short)
    assert len(head) == HEAD_BYTES and tail == b""
    assert decode_head(head) == (Preamble(KIND_DATA, 7, len(short)), short)

    long = encode_header("l", [Run(i, 2 * i, 1) for i in range(1000)])
    head, tail = encode_head(KIND_DATA, 8, long)
    assert len(head) == HEAD_BYTES and len(tail) == PREAMBLE_BYTES + len(long) - HEAD_BYTES
    preamble, part = decode_head(head)
    assert preamble.header_len == len(long)
    assert decode_header(part + tail).runs == tuple((2 * i, 1) for i in range(1000))


def test_decode_preamble_rejects_garbage():
    with pytest.raises(ValueError, match="not a KV transfer preamble"):
        decode_preamble(b"\0" * PREAMBLE_BYTES)


def test_plan_message_validates_source_against_the_cache():
    runs, header = plan_message("t", [0, 1], [5, 6], num_blocks=2)
    assert runs == [Run(0, 5, 2)]
    assert decode_header(header).runs == ((5, 2),)
    with pytest.raises(ValueError):
        plan_message("t", [2], [0], num_blocks=2)


# -- the receiver's table ----------------------------------------------------------------------
def _table(timeout_s: float = 5.0) -> tuple[ExpectedTransfers, Counters]:
    counters = Counters()
    return ExpectedTransfers(timeout_s, counters), counters


def test_transfer_completes_when_all_blocks_landed_in_any_order():
    table, counters = _table()
    handle = table.expect("a", [3, 1, 2])
    assert table.claim("a", [2], peer="p")
    table.landed("a", [2], 100, 0.1)
    assert not handle.done()
    assert table.claim("a", [3, 1], peer="p")
    table.landed("a", [3, 1], 200, 0.1)
    handle.wait(0)
    assert handle.nbytes == 300
    assert counters.snapshot().bytes == 300
    assert counters.snapshot().transfers_ok == 1
    assert table.pending() == 0


def test_unknown_or_unexpected_blocks_are_not_claimed():
    table, _ = _table()
    handle = table.expect("a", [1, 2])
    assert not table.claim("nobody", [1], peer="p")
    assert not table.claim("a", [1, 5], peer="p")  # block 5 is not ours: the transfer fails
    with pytest.raises(TransferError, match="unexpected blocks"):
        handle.wait(0)


def test_blocks_cannot_be_expected_twice_while_pending():
    table, _ = _table()
    table.expect("a", [1, 2])
    with pytest.raises(ValueError, match="already belong"):
        table.expect("b", [2, 3])
    with pytest.raises(ValueError, match="already expected"):
        table.expect("a", [7])
    table.cancel("a")
    table.expect("b", [2, 3])  # released once the cancelled transfer settled


def test_a_transfer_given_up_for_a_lost_sender_is_remembered_and_a_plain_cancel_is_not(monkeypatch):
    """The UCX receiver leaves such a transfer's late messages unreceived (``UcxReceiver._receive``):
    posting a receive for a dead sender's rendezvous message crashed UCX in tests/hosts."""
    from baton.common.transfer import bookkeeping

    monkeypatch.setattr(bookkeeping, "LOST_KEPT", 2)
    table, _ = _table()
    for tid in ("plain", "lost-1", "lost-2", "lost-3"):
        handle = table.expect(tid, [1, 2])
        table.cancel(tid, sender_lost=tid.startswith("lost"))
        with pytest.raises(TransferError, match="cancelled"):
            handle.wait(0)
        assert not table.claim(tid, [1], peer="p")  # a late message lands nowhere
    assert not table.sender_lost("plain")  # its late payload is received and dropped
    assert [table.sender_lost(t) for t in ("lost-1", "lost-2", "lost-3")] == [False, True, True]


def test_cancel_waits_for_a_message_in_flight_before_failing():
    table, counters = _table()
    handle = table.expect("a", [1, 2])
    assert table.claim("a", [1], peer="p")
    table.cancel("a")
    assert not handle.done()  # block 1 is still being written
    assert not table.claim("a", [2], peer="p")  # nothing new lands after cancel
    table.landed("a", [1], 100, 0.1)
    with pytest.raises(TransferError, match="cancelled"):
        handle.wait(0)
    assert counters.snapshot().transfers_failed == 1


def test_deadline_fails_the_transfer_on_sweep():
    table, _ = _table()
    handle = table.expect("a", [1], timeout_s=0.05)
    table.sweep()
    assert not handle.done()
    table.sweep(time.monotonic() + 0.1)
    with pytest.raises(TransferError, match="timed out"):
        handle.wait(0)


def test_stuck_message_cannot_hold_a_failed_transfer_forever():
    table, _ = _table(timeout_s=0.05)
    handle = table.expect("a", [1])
    assert table.claim("a", [1], peer="p")
    table.sweep(time.monotonic() + 0.06)  # deadline: failed, but a message is in flight
    assert not handle.done()
    table.sweep(time.monotonic() + 0.2)  # a further timeout_s later it fails anyway
    assert handle.done() and not handle.ok()


def test_lost_peer_fails_only_the_transfers_it_wrote():
    table, _ = _table()
    touched, untouched = table.expect("a", [1, 2]), table.expect("b", [3])
    assert table.claim("a", [1], peer="p")
    table.landed("a", [1], 10, 0.0)
    table.fail_peer("p", TransferError("peer p lost"))
    with pytest.raises(TransferError, match="peer p lost"):
        touched.wait(0)
    assert not untouched.done()


def test_close_fails_everything_pending():
    table, _ = _table()
    handles = [table.expect("a", [1]), table.expect("b", [2])]
    table.close(TransferError("closed"))
    assert all(h.done() and not h.ok() for h in handles)


# -- handles and the sender's ledger -------------------------------------------------------------
def test_handle_wait_bounds_and_callbacks():
    handle = TransferHandle("t")
    seen = []
    handle.add_done_callback(seen.append)
    with pytest.raises(TransferError, match="not done after 0.01 s"):
        handle.wait(0.01)
    assert handle.set_result(5) and not handle.set_error(TransferError("late"))
    handle.wait(0)
    assert seen == [handle] and handle.nbytes == 5


def test_finish_joins_every_send_of_a_transfer():
    ledger = SendLedger()
    sends = [TransferHandle("t"), TransferHandle("t")]
    for h in sends:
        ledger.add(h)
    finished = ledger.finish("t")
    sends[0].set_result(10)
    assert not finished.done()
    sends[1].set_error(TransferError("boom"))
    with pytest.raises(TransferError, match="boom"):
        finished.wait(0)
    assert ledger.finish("never-sent").ok()
    assert all_of("x", []).ok()


# -- config, descriptor, import ------------------------------------------------------------------
def test_config_rejects_unknown_backend_and_bad_timeout():
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(backend="tcp")
    with pytest.raises(ValueError, match="timeout_s"):
        TransferConfig(timeout_s=0)


def test_descriptor_round_trips_through_a_dict():
    d = TransferDescriptor("nccl", host="10.0.0.2", port=4242, address="")
    assert TransferDescriptor.from_dict(d.to_dict()) == d


def test_package_import_pulls_in_no_torch_and_no_transport():
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "import baton.common.transfer as t\n"
        "assert 'ucxx' not in sys.modules and 'baton.common.transfer.ucx' not in sys.modules\n"
        "t.TransferConfig(backend='nccl')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_fault_hold_stops_a_transfer_mid_message_after_its_first_blocks_and_sends_nothing_after():
    from baton.common.transfer.bookkeeping import FaultHold

    hold = FaultHold(8)
    assert [hold.next_message("a", 4) for _ in range(2)] == [FaultHold.WHOLE] * 2
    assert hold.next_message("b", 4) == FaultHold.WHOLE  # counted per transfer
    assert hold.next_message("a", 4) == FaultHold.HEAD_ONLY
    assert hold.next_message("a", 4) == FaultHold.NOTHING
    assert FaultHold(0).next_message("a", 100) == FaultHold.WHOLE  # off
    with pytest.raises(ValueError, match="negative"):
        TransferConfig(fault_hold_payload_after_blocks=-1)
