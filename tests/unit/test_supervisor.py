"""``baton up``'s supervision: the backoff policy (pure), and a ``Supervisor`` restarting real child
processes on a clock the test moves."""

from __future__ import annotations

import signal

import pytest

from baton.services.procs import Backoff, Supervisor, describe_exit


def test_backoff_doubles_up_to_the_cap_and_resets_after_a_healthy_run():
    b = Backoff(initial_s=0.5, max_s=4.0, reset_after_s=60.0)
    waits, n = [], 0
    for _ in range(6):
        wait, n = b.next(ran_s=1.0, exits_in_a_row=n)
        waits.append(wait)
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert n == 6
    assert b.next(ran_s=60.0, exits_in_a_row=n) == (0.5, 1)  # it ran long enough: healthy again
    assert b.next(ran_s=59.9, exits_in_a_row=n) == (4.0, 7)


def test_exit_codes_are_described_with_their_signal():
    assert describe_exit(3) == "code 3"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(0) == "code 0"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def crashing():
    """A supervisor of one child that exits with code 3 at once, on a clock the test moves."""
    clock, restarts = _Clock(), []
    sup = Supervisor(
        backoff=Backoff(initial_s=0.5, max_s=2.0, reset_after_s=60.0),
        on_restart=lambda name, code: restarts.append((name, code, clock.now)),
        clock=clock,
    )
    sup.spawn("crasher", ["sh", "-c", "exit 3"])
    yield sup, clock, restarts
    sup.stop(5)


def _wait_exit(sup: Supervisor, name: str) -> None:
    dict(sup.procs)[name].wait(10)  # bounded; raises TimeoutExpired if it never exits


def test_a_child_that_exits_is_restarted_with_backoff(crashing):
    sup, clock, restarts = crashing
    for i, wait in enumerate([0.5, 1.0, 2.0, 2.0]):
        _wait_exit(sup, "crasher")
        sup.supervise()  # notes the exit now, schedules the restart
        clock.now += wait - 0.01
        sup.supervise()
        assert len(restarts) == i, "restarted before its backoff was over"
        clock.now += 0.01
        sup.supervise()
        assert len(restarts) == i + 1
        assert restarts[-1][:2] == ("crasher", 3)
    assert [p for _, p in sup.procs][0].pid > 0 and len(sup.procs) == 1


def test_a_child_that_ran_long_is_restarted_after_the_initial_wait(crashing):
    sup, clock, restarts = crashing
    for _ in range(3):  # three quick exits: the next wait would be 2 s
        _wait_exit(sup, "crasher")
        sup.supervise()
        clock.now += 2.0
        sup.supervise()
    assert len(restarts) == 3
    _wait_exit(sup, "crasher")
    clock.now += 60.0  # it had run a minute before this exit
    sup.supervise()
    clock.now += 0.5
    sup.supervise()
    assert len(restarts) == 4


def test_stop_ends_children_for_good():
    sup = Supervisor(backoff=Backoff(initial_s=0.0))
    sup.spawn("sleeper", ["sleep", "30"])
    proc = dict(sup.procs)["sleeper"]
    sup.stop(5)
    assert proc.returncode == -signal.SIGTERM
    assert sup.dead() == [("sleeper", -signal.SIGTERM)]
