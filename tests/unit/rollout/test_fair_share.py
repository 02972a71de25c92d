"""A replica's task slots among runs (`FairShare`), on a clock the test moves: strict
priority, the hold a higher priority keeps after its work and while its tasks run, and when
that hold is let go (its pauses outlast it: the slots it kept free would refill anyway)."""

from __future__ import annotations

import pytest

from treadle_common import names
from treadle_common.fleet import scheduling
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_rollout.fair_share import PRIORITY_HOLD_S, FairShare

pytestmark = pytest.mark.unit

HIGH, LOW = names.tasks_stream("eval"), names.tasks_stream("train")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def share() -> tuple[FairShare, Clock]:
    clock = Clock()
    fair = FairShare(scheduling.WeightedFairShare(), None, clock=clock)
    fair.claims[HIGH] = scheduling.Claim("eval", priority=1)
    fair.claims[LOW] = scheduling.Claim("train")
    return fair, clock


def put(fair: FairShare, stream: str, at: float) -> None:
    fair.ready.setdefault(stream, []).append(("1-0", task_pb2.Task(created_at=at), at))


def start(fair: FairShare, stream: str):
    """The policy's turn: the stream's first ready task leaves the queue and is charged."""
    fair.ready[stream].pop(0)
    return fair.charge(fair.claims[stream])


def test_a_higher_priority_goes_first_and_holds_its_slots_while_its_tasks_run(share):
    fair, clock = share
    put(fair, LOW, 1.0)
    put(fair, HIGH, 2.0)  # fed later, still first
    gone, eligible = fair.contenders({HIGH, LOW})
    assert gone == [] and fair.pick(eligible) == HIGH
    settle = start(fair, HIGH)
    clock.now += 60  # long after its last ready task: only its running task holds
    assert fair.contenders({HIGH, LOW}) == ([], [])
    settle()
    clock.now += PRIORITY_HOLD_S / 2  # between two steps of a sync run: still held
    assert fair.contenders({HIGH, LOW}) == ([], [])
    clock.now += PRIORITY_HOLD_S
    assert fair.contenders({HIGH, LOW}) == ([], [LOW])


def test_a_run_whose_pauses_outlast_the_hold_no_longer_holds_while_its_tasks_run(share):
    fair, clock = share
    put(fair, HIGH, clock.now)
    start(fair, HIGH)()  # one task, ended: the run pauses (trains) from here
    clock.now += 3 * PRIORITY_HOLD_S
    put(fair, HIGH, clock.now)  # its next step: a pause longer than the hold
    put(fair, LOW, clock.now)
    assert fair.pick(fair.contenders({HIGH, LOW})[1]) == HIGH
    settle = start(fair, HIGH)
    clock.now += 60
    # its task still runs, but what the hold would keep free refills before its next step
    assert fair.contenders({HIGH, LOW}) == ([], [LOW])
    settle()


def test_a_run_whose_pauses_are_short_keeps_holding(share):
    fair, clock = share
    put(fair, HIGH, clock.now)
    start(fair, HIGH)()
    clock.now += PRIORITY_HOLD_S / 4  # a short training step
    put(fair, HIGH, clock.now)
    put(fair, LOW, clock.now)
    start(fair, HIGH)
    clock.now += 60
    assert fair.contenders({HIGH, LOW}) == ([], [])


def test_a_run_whose_tasks_hold_slots_longer_is_charged_for_the_time(share):
    fair, clock = share
    fair.claims[HIGH] = scheduling.Claim("eval")  # equal priority, equal weight
    for _ in range(3):
        put(fair, HIGH, clock.now)
        put(fair, LOW, clock.now)
        slow, fast = start(fair, HIGH), start(fair, LOW)
        clock.now += 1
        fast()
        clock.now += 9
        slow()
    put(fair, HIGH, clock.now)
    put(fair, LOW, clock.now)
    assert fair.pick(fair.contenders({HIGH, LOW})[1]) == LOW  # eval held 10 s a task, train 1
