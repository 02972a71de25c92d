"""Injected faults (session option `faults`): which sessions of which episodes fail."""

import pytest

from treadle_env_gateway.envs.base import Action, EnvError
from treadle_env_gateway.sessions import SessionManager

pytestmark = pytest.mark.unit
TASK = {"a": 1, "b": 2, "op": "+", "answer": "3"}


def _attempts(faults: SessionManager, options: dict, seed: int, n: int) -> list[bool]:
    """For `n` sessions of the episode (TASK, seed): whether each one failed."""
    return [faults.faults.check(options, f"{TASK}:{seed}") is not None for _ in range(n)]


def test_an_episode_fails_its_first_attempts_then_plays():
    manager = SessionManager("g")
    assert _attempts(manager, {"faults": {"fail_first": 2}}, 7, 4) == [True, True, False, False]
    assert _attempts(manager, {"faults": {"fail_first": 2}}, 8, 1) == [True]  # its own count
    assert _attempts(manager, {}, 9, 2) == [False, False]


def test_a_rule_picks_the_same_share_of_episodes_every_time():
    options = {"faults": [{"fail_first": 5, "rate": 0.25}, {"fail_first": 1}]}
    first = [_attempts(SessionManager("g"), options, seed, 2) for seed in range(400)]
    again = [_attempts(SessionManager("g"), options, seed, 2) for seed in range(400)]
    assert first == again  # picked by a hash, not by chance
    always = sum(a == [True, True] for a in first)
    assert 70 <= always <= 130  # a quarter of 400, give or take
    assert all(a in ([True, True], [True, False]) for a in first)  # the rest: the 2nd rule


async def test_a_failing_session_ends_at_its_first_step_as_an_env_error():
    """It opens (a group's sessions open in one call, all or none), then fails as an env
    that raises does; the episode's next session plays."""
    manager = SessionManager("g")
    for fails in (True, False):
        session, _ = await manager.create("arith", TASK, 1, {"faults": {"fail_first": 1}})
        result = await manager.step(session.session_id, Action(text="3"))
        assert result.done
        assert (result.status == "env_error") is fails
        assert ("injected fault" in (result.error or "")) is fails


async def test_bad_fault_rules_are_named_before_a_run_starts():
    manager = SessionManager("g")
    for bad, why in (
        ({"faults": "often"}, "must be an object or a list"),
        ({"faults": {"fail_first": -1}}, "fail_first"),
        ({"faults": {"rate": 2}}, "rate"),
        ({"faults": {"fail": 1}}, "unknown keys"),
    ):
        with pytest.raises(EnvError, match=why):
            await manager.sample_tasks("arith", 1, 0, "train", bad)
