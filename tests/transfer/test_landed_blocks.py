"""What a receiver knows about a transfer that failed part-way: which destination blocks hold whole,
valid KV (``landed_block_ids``) once nothing writes them any more, and how far a live transfer has
got (``progress``). The decode worker keeps the landed blocks of a dead prefill worker's transfer
and recomputes only the rest. Pure bookkeeping: no torch, no transport."""

from __future__ import annotations

import time

import pytest

from baton.common.transfer.base import TransferError
from baton.common.transfer.bookkeeping import Counters, ExpectedTransfers


def _table(timeout_s: float = 5.0) -> ExpectedTransfers:
    return ExpectedTransfers(timeout_s, Counters())


def _land(table: ExpectedTransfers, tid: str, blocks: list[int]) -> None:
    assert table.claim(tid, blocks, peer="p")
    table.landed(tid, blocks, 10 * len(blocks), 0.0)


def test_a_completed_transfer_reports_every_block_landed():
    table = _table()
    handle = table.expect("a", [4, 5, 6])
    _land(table, "a", [5])
    _land(table, "a", [4, 6])
    handle.wait(0)
    assert handle.landed_block_ids == {4, 5, 6}


def test_cancel_keeps_the_blocks_that_landed_before_it_and_not_a_late_message():
    table = _table()
    handle = table.expect("a", [10, 11, 12, 13])
    _land(table, "a", [10, 11])
    assert table.claim("a", [12], peer="p")  # in flight when the transfer is given up
    table.cancel("a")
    assert not handle.done()  # block 12 is still being written: its blocks are not free yet
    table.landed("a", [12], 10, 0.0)  # whole, but its sender may have given up on it: not kept
    with pytest.raises(TransferError, match="cancelled"):
        handle.wait(0)
    assert handle.landed_block_ids == {10, 11}


def test_progress_counts_landed_blocks_and_when_the_latest_landed():
    table = _table()
    table.expect("a", [1, 2, 3])
    assert table.progress("a").blocks_landed == 0 and table.progress("a").last_landed is None
    before = time.monotonic()
    _land(table, "a", [2])
    p = table.progress("a")
    assert (p.blocks_landed, p.blocks_expected) == (1, 3) and p.last_landed >= before
    assert table.claim("a", [1], peer="p")
    assert table.progress("a").blocks_landed == 1  # claimed is not landed
    table.landed("a", [1], 10, 0.0)
    _land(table, "a", [3])
    assert table.progress("a") is None  # settled
    assert table.progress("never") is None


def test_nothing_lands_after_the_deadline_even_before_the_sweep_runs():
    table = _table()
    late = table.expect("late", [1, 2], timeout_s=0.05)
    _land(table, "late", [1])
    assert table.claim("late", [2], peer="p")
    time.sleep(0.06)
    table.landed("late", [2], 10, 0.0)  # completes past the deadline: the transfer failed
    with pytest.raises(TransferError, match="timed out"):
        late.wait(0)
    assert late.landed_block_ids == {1}

    refused = table.expect("refused", [3], timeout_s=0.05)
    time.sleep(0.06)
    assert not table.claim("refused", [3], peer="p")  # received into scratch, never the cache
    with pytest.raises(TransferError, match="timed out"):
        refused.wait(0)
    assert refused.landed_block_ids == frozenset()


def test_a_failed_message_lands_nothing_of_its_own():
    table = _table()
    handle = table.expect("a", [1, 2, 3])
    _land(table, "a", [1])
    assert table.claim("a", [2, 3], peer="p")
    table.landed("a", [2, 3], 0, 0.0, TransferError("peer lost mid-message"))
    with pytest.raises(TransferError, match="peer lost"):
        handle.wait(0)
    assert handle.landed_block_ids == {1}


def test_after_cancel_progress_names_the_blocks_landed_and_those_still_being_written():
    table = _table()
    handle = table.expect("a", [10, 11, 12, 13, 14])
    _land(table, "a", [10, 11])
    assert table.claim("a", [12, 13], peer="p")  # a message's head came; its payload has not
    p = table.progress("a")
    assert (p.landed_block_ids, p.writing_block_ids) == ({10, 11}, {12, 13})
    table.cancel("a")
    assert not table.claim("a", [14], peer="p")  # nothing new is claimed: 14 is never written
    p = table.progress("a")
    assert (p.landed_block_ids, p.writing_block_ids) == ({10, 11}, {12, 13})
    assert not handle.done()
    table.landed("a", [12, 13], 20, 0.0, TransferError("peer gone"))
    assert handle.done() and table.progress("a") is None
