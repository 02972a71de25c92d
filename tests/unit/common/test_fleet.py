"""Many runs, one fleet: which runs may share a model (`fleet.conflict`), each LoRA run's own
policy model, and a recipe's scheduling fields."""

import pytest

from treadle_common import names
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import runs as fleet

pytestmark = pytest.mark.unit


def policy(run: str, base: str = "tiny", lora: bool = False) -> fleet.RunPolicy:
    model = names.adapter_policy(base, run) if lora else base
    return fleet.RunPolicy(run_id=run, policy=model, base=base, lora=lora)


def test_lora_runs_share_a_base_and_a_full_weight_run_needs_its_model_alone():
    loras = [policy("a", lora=True), policy("b", lora=True)]
    assert fleet.conflict(policy("c", lora=True), loras) is None
    why = fleet.conflict(policy("full"), loras)
    assert why is not None and "run a is a LoRA run on tiny" in why
    assert "full-weight run of tiny" in (
        fleet.conflict(policy("d", lora=True), [policy("f")]) or ""
    )
    assert fleet.conflict(policy("g"), [policy("f")]) is not None
    assert fleet.conflict(policy("g", base="other"), [policy("f"), *loras]) is None
    assert fleet.conflict(policy("f"), [policy("f")]) is None  # itself (a resumed run)


def test_a_lora_run_names_its_own_policy_model_and_a_full_weight_run_its_model():
    base = {"model": {"path": "m", "name": "tiny"}, "run_id": "r1"}
    assert RunConfig.model_validate(base).policy_model == "tiny"
    lora = RunConfig.model_validate({**base, "trainer": {"lora": {"rank": 4}}})
    assert lora.policy_model == "tiny.r1" and names.valid_name(lora.policy_model)
    long = {**base, "model": {"path": "m", "name": "m" * 100}, "run_id": "r" * 40}
    with pytest.raises(ValueError, match="longer than 128"):
        RunConfig.model_validate({**long, "trainer": {"lora": {"rank": 4}}})
    assert RunConfig.model_validate(long).policy_model == "m" * 100  # full weights: its model


def test_scheduling_fields_are_validated():
    base = {"model": {"path": "m"}}
    cfg = RunConfig.model_validate({**base, "scheduling": {"weight": 2, "priority": 5}})
    assert (cfg.scheduling.weight, cfg.scheduling.priority) == (2.0, 5)
    with pytest.raises(ValueError):
        RunConfig.model_validate({**base, "scheduling": {"weight": 0}})


def test_weighted_fair_share_gives_shares_by_weight_and_priority_first():
    from treadle_common.fleet import scheduling

    policy = scheduling.WeightedFairShare()
    claims = [scheduling.Claim("a", 2.0), scheduling.Claim("b"), scheduling.Claim("c")]
    picks = []
    for _ in range(40):
        chosen = policy.pick(claims)
        policy.charge(chosen, 1.0)
        picks.append(chosen.run_id)
    assert {k: picks.count(k) for k in "abc"} == {"a": 20, "b": 10, "c": 10}
    urgent = scheduling.Claim("u", priority=1)
    assert policy.pick([*claims, urgent]) is urgent
    late = scheduling.Claim("late")  # joins at the least-served peer's time: no banked credit
    policy.pick([*claims, late])
    assert policy.vtime["late"] == min(policy.vtime[c] for c in "abc")


async def test_fair_turns_hand_the_thread_to_the_policys_pick():
    import asyncio

    from treadle_common.fleet import scheduling

    turns = scheduling.FairTurns(scheduling.WeightedFairShare())
    order = []

    async def step(claim):
        async with turns.turn(claim):
            order.append(claim.run_id)
            await asyncio.sleep(0.001)

    hold = asyncio.Event()

    async def first():
        async with turns.turn(scheduling.Claim("x")):
            await hold.wait()

    holder = asyncio.create_task(first())
    await asyncio.sleep(0)
    waiting = [
        asyncio.create_task(step(scheduling.Claim(r, priority=p)))
        for r, p in (("low", 0), ("high", 2), ("mid", 1))
    ]
    await asyncio.sleep(0.01)
    hold.set()
    await asyncio.gather(holder, *waiting)
    assert order == ["high", "mid", "low"]
    assert turns.granted == {"x": 1, "high": 1, "mid": 1, "low": 1}


async def test_fair_turns_with_two_holders_run_two_at_once_and_never_three():
    import asyncio

    from treadle_common.fleet import scheduling

    turns = scheduling.FairTurns(scheduling.WeightedFairShare(), holders=2)
    now, most = 0, 0

    async def step(run: str):
        nonlocal now, most
        async with turns.turn(scheduling.Claim(run)):
            now += 1
            most = max(most, now)
            await asyncio.sleep(0.01)
            now -= 1

    await asyncio.gather(*(step(r) for r in "abcdef"))
    assert most == 2 and turns.granted == dict.fromkeys("abcdef", 1)


def test_the_multirun_bench_measures_fairness_and_shares_as_defined():
    from types import SimpleNamespace

    from treadle_bench.multirun import jain, share_error, window_rates

    assert jain([1.0, 1.0, 1.0, 1.0]) == 1.0 and jain([4.0, 0.0, 0.0, 0.0]) == 0.25
    assert share_error([2.0, 1.0, 1.0, 1.0], [2, 1, 1, 1]) == pytest.approx(0.0)
    assert share_error([1.0, 1.0], [2, 1]) == pytest.approx(0.5)  # b got 1/2, owed 1/3

    def run(finished: list[float]):
        steps = [SimpleNamespace(finished_at=t, duration_s=1.0) for t in finished]
        return SimpleNamespace(status=SimpleNamespace(steps=steps), finished_at=lambda: finished)

    # both run during (1, 4] (b's first step starts at 1, b ends at 4): a finishes 3 steps
    # in it, b (half as fast) 2
    rates = window_rates([run([1.0, 2.0, 3.0, 4.0, 5.0]), run([2.0, 4.0])])
    assert rates == pytest.approx([3 / 3, 2 / 3])
