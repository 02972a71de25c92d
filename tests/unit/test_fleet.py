"""Many runs, one fleet: which runs may share a model (`fleet.conflict`), each LoRA run's own
policy model, and a recipe's scheduling fields."""

import pytest

from treadle_common import fleet, names
from treadle_common.config import RunConfig

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
