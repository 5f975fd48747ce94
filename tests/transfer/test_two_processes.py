"""Both transports between two real processes: bit-exact blocks, a receiver busy decoding,
cancel, timeout, a killed sender. One receiver/sender pair per backend runs the whole script
(``peers.py``); each test below checks one part of its report.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from tests.transfer import peers
from tests.transfer.backends import CPU_BACKENDS as BACKENDS

pytestmark = pytest.mark.slow
STEP_S = 60.0  # bound on any one wait for a peer process


def _recv(conn, what: str):
    if not conn.poll(STEP_S):
        raise TimeoutError(f"no {what} within {STEP_S} s")
    return conn.recv()


def _tagged(conn, tag: str):
    got, report = _recv(conn, tag)
    assert got == tag, (got, report)
    return report


def _script(receiver, sender, sender_proc) -> dict:
    """Relay between the receiver's script and the sender; returns every report."""
    reports = {}
    sender.send(_recv(receiver, "descriptors"))
    assert _recv(receiver, "phase 1 ready") == "ready"
    for name in peers.CACHES:
        plan = peers.make_plan(peers.CACHES[name][0][0], seed=len(name))
        sender.send((name, f"x-{name}", plan))
        assert _recv(sender, f"sent {name}") == "sent"
    reports["busy"] = _tagged(receiver, "phase1")

    asked, ids = _recv(receiver, "cancel request")
    assert asked == "send_to_cancelled"
    sender.send(("tiny", "cancelled", [(list(range(len(ids))), ids)]))
    reports["late_send"] = _recv(sender, "late send")
    receiver.send("sent")
    reports["cancel"] = _tagged(receiver, "phase2")

    sender.send("stats")
    reports["sender_stats"] = _recv(sender, "sender stats")
    assert _recv(receiver, "phase 3 ready") == "ready"
    sender.send(("real", "dead", [(list(range(4)), list(range(4)))]))
    assert _recv(sender, "half of the dead transfer") == "sent"
    os.kill(sender_proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    reports["dead"] = _tagged(receiver, "phase3")
    reports["dead"]["since_kill_s"] = time.monotonic() - killed
    reports["closed"] = _tagged(receiver, "closed")
    return reports


@pytest.fixture(scope="module", params=BACKENDS)
def session(request):
    backend = request.param
    ctx = mp.get_context("spawn")
    recv_parent, recv_child = ctx.Pipe()
    send_parent, send_child = ctx.Pipe()
    procs = [
        ctx.Process(target=peers.run_receiver, args=(backend, recv_child), daemon=True),
        ctx.Process(target=peers.run_sender, args=(backend, send_child), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        reports = _script(recv_parent, send_parent, procs[1])
        procs[0].join(STEP_S)
        reports["receiver_exitcode"] = procs[0].exitcode
        yield backend, reports
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def test_blocks_land_bit_exact(session):
    _, r = session
    busy = r["busy"]
    assert busy["errors"] == {}
    assert busy["exact"] == {"tiny": True, "real": True}
    for name, (shape, _) in peers.CACHES.items():
        count = len(peers.flat(peers.make_plan(shape[0], seed=len(name)))[1])
        block_bytes = busy["stats"][name].bytes // count
        assert busy["nbytes"][name] == busy["stats"][name].bytes == count * block_bytes
    assert busy["stats"]["real"].bytes == 6 * 368_640
    assert all(s.transfers_ok == 1 for s in busy["stats"].values())


def test_blocks_not_targeted_are_untouched(session):
    _, r = session
    assert r["busy"]["untouched"] == {"tiny": True, "real": True}


def test_busy_receiver_main_loop_keeps_stepping(session):
    # The transfer lands while the main thread runs matmuls; its steps never stall on the receive.
    _, r = session
    busy = r["busy"]
    assert busy["steps"] >= 20, busy
    assert busy["max_gap_s"] < 0.25, busy


def test_sender_counts_what_it_sent(session):
    _, r = session
    stats = r["sender_stats"]
    assert stats["real"].bytes == 6 * 368_640
    assert stats["tiny"].transfers_ok == 3 + 1  # three chunks, then the late send to "cancelled"
    assert all(s.transfers_failed == 0 for s in stats.values())


def test_cancelled_transfer_fails_at_once_and_late_data_is_dropped(session):
    _, r = session
    c = r["cancel"]
    assert c["cancel_error"] and "cancelled" in c["cancel_error"]
    assert c["cancel_s"] < 0.5
    assert r["late_send"] == "sent"
    assert c["dropped_bytes"] == c["expected_drop"]
    assert c["cancelled_untouched"]


def test_expected_transfer_times_out_within_bound(session):
    _, r = session
    c = r["cancel"]
    assert c["timeout_error"] and "timed out" in c["timeout_error"]
    assert 0.9 <= c["timeout_s"] < 1.5


def test_killed_sender_fails_the_wait_within_timeout(session):
    backend, r = session
    dead = r["dead"]
    assert dead["dead_error"] is not None
    assert dead["dead_wait_s"] < peers.DEAD_TIMEOUT_S + 1.0
    if backend == "nccl":  # gloo sees the connection close: no need to wait for the deadline
        assert dead["since_kill_s"] < 2.0, dead


def test_receiver_closes_promptly_and_exits(session):
    _, r = session
    assert r["closed"]["close_s"] < 3.0
    assert r["receiver_exitcode"] == 0
