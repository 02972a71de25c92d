"""Paced shares on the trainer's turns (`treadle_common.fleet.pacing`): step counts follow the
weights among runs that keep up; a stalled run holds the others back for a window at most."""

import asyncio

import pytest

from treadle_common.fleet import scheduling
from treadle_common.fleet.pacing import Pacing

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def take(pacing: Pacing, claim: scheduling.Claim) -> float | None:
    """Ask for a turn; take it unless held (then give the wait up). The hold."""
    pacing.request(claim)
    held = pacing.hold(claim)
    if held is None:
        pacing.granted(claim)
    pacing.done(claim)
    return held


def test_a_run_a_lead_ahead_of_a_peer_that_keeps_up_waits_and_a_newcomer_starts_level():
    clock = Clock()
    pacing = Pacing(lead=2.0, min_window_s=1.0, clock=clock)
    a, b = scheduling.Claim("a"), scheduling.Claim("b")
    assert take(pacing, b) is None  # b: 1
    assert take(pacing, a) is None and take(pacing, a) is None  # a joined at 1: 3, two ahead
    clock.now += 0.5
    assert take(pacing, a) == pytest.approx(100.0 + 1.0)  # until b's window ends
    assert take(pacing, b) is None  # b catches up by one: a may go again
    assert take(pacing, a) is None
    late = scheduling.Claim("late")
    pacing.request(late)  # joins level with the least advanced peer: no banked credit
    assert pacing.hold(late) is None
    assert pacing._runs["late"].units == pacing._runs["b"].units
    pacing.done(late)
    # b stops: once its last turn is a window old it no longer holds a back
    clock.now += 5
    for _ in range(5):
        assert take(pacing, a) is None
        assert take(pacing, late) is None
    # b comes back level with the least advanced peer that kept up, not 5 turns behind
    pacing.request(scheduling.Claim("b"))
    assert pacing._runs["b"].units == min(pacing._runs[r].units for r in ("a", "late"))


def test_weights_scale_the_lead_and_priorities_do_not_pace_each_other():
    clock = Clock()
    pacing = Pacing(lead=2.0, clock=clock)
    heavy, light = scheduling.Claim("h", weight=2.0), scheduling.Claim("l")
    assert take(pacing, light) is None
    turns = 0
    while take(pacing, heavy) is None:
        turns += 1
    # heavy joined level with light (1 unit); 4 turns of 1/2 unit put it two ahead
    assert turns == 4
    urgent = scheduling.Claim("u", priority=5)
    for _ in range(10):  # a higher priority is never held back by lower ones
        assert take(pacing, urgent) is None


async def run_for(turns: scheduling.FairTurns, claim, steps: int, cycle: float) -> None:
    for _ in range(steps):
        await asyncio.sleep(cycle)
        async with turns.turn(claim):
            await asyncio.sleep(0.001)


async def test_paced_turns_give_step_counts_by_weight_among_runs_that_keep_up():
    pacing = Pacing(lead=2.0, min_window_s=5.0)  # no run drops out, even on a loaded machine
    turns = scheduling.FairTurns(scheduling.WeightedFairShare(), pacing=pacing)
    claims = [scheduling.Claim("w2", 2.0), *(scheduling.Claim(f"w1-{i}") for i in range(3))]
    heavy = asyncio.create_task(run_for(turns, claims[0], 40, 0.002))
    light = [asyncio.create_task(run_for(turns, c, 1000, 0.002)) for c in claims[1:]]
    await asyncio.wait_for(heavy, 60)  # a hang guard, not a timing assert
    counts = dict(turns.granted)
    for task in light:
        task.cancel()
    await asyncio.gather(*light, return_exceptions=True)
    assert counts["w2"] == 40
    for i in range(3):  # the same cycle: unpaced each would have had about 40
        assert 20 - 3 <= counts[f"w1-{i}"] <= 20 + 3, counts
    assert sum(turns.held_s.values()) > 0


async def test_a_stalled_run_holds_the_others_back_for_a_window_at_most():
    pacing = Pacing(lead=2.0, min_window_s=0.5)  # long enough that it is held first
    turns = scheduling.FairTurns(scheduling.WeightedFairShare(), pacing=pacing)
    await run_for(turns, scheduling.Claim("stalls"), 1, 0.0)  # one turn, then nothing
    await asyncio.wait_for(run_for(turns, scheduling.Claim("goes-on"), 30, 0.001), 60)
    assert turns.granted["goes-on"] == 30  # unbounded, the stalled run would hold it forever
    assert turns.held_s["goes-on"] > 0  # it was held (once its lead reached 2)
