"""``OutageLog``: one line when a dependency goes away, a reminder while it stays away, one line when
it is back; not one per failed call. Pure (a fake clock)."""

from __future__ import annotations

import logging

from baton.common.index.outage import OutageLog


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_logs_its_start_reminders_and_its_end(caplog):
    clock = _Clock()
    outage = OutageLog(logging.getLogger("test.outage"), "thing", every_s=30.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="test.outage")
    assert not outage.ok() and not outage.down  # up, and nothing to say
    for _ in range(50):  # 50 failures within 10 s: one line
        outage.failed(ConnectionError("refused"))
        clock.now += 0.2
    assert outage.down and outage.down_since == 100.0
    assert [r.getMessage() for r in caplog.records] == [
        "thing unreachable: refused (retrying; logged again every 30 s)"
    ]
    clock.now = 131.0
    outage.failed(TimeoutError("timed out"))  # a reminder after 30 s
    outage.failed(TimeoutError("timed out"))  # not two
    assert (
        len(caplog.records) == 2
        and "still unreachable after 31 s (51 failures)" in caplog.records[1].getMessage()
    )
    clock.now = 140.0
    assert outage.ok() is True  # the first success after failures says so
    assert "reachable again after 40.0 s (52 failures)" in caplog.records[2].getMessage()
    assert outage.ok() is False and not outage.down
    outage.failed(OSError("again"))  # a new outage starts a new count
    assert "thing unreachable: again" in caplog.records[3].getMessage()
