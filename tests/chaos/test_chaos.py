"""`treadle bench chaos` as a test: an async run on the embedded stack while every service is
SIGKILLed (rollout mid-episode, reward, env-gateway with live sessions, weight-store right
after a step, the trainer mid-step), redis-server and nats-server restart, a second rollout
replica dies holding tasks, and a second trainer takes the run over (SIGTERM hand-off).
The run must complete with every produced trajectory trained exactly once or dropped with a
reason (from its ledger), and no service may log a traceback."""

import pytest

from tests.support.services import ROOT
from treadle_bench import chaos

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]


@pytest.mark.timeout(1500)
def test_a_run_survives_every_fault_losing_and_doubling_nothing():
    result = chaos.run(steps=600, recipe=ROOT / "recipes" / "chaos.yaml", baseline=False)
    faults = {f["name"]: f for f in result["faults"]}
    assert not result["fault_errors"] and result["faults_injected"] == len(faults) >= 10
    assert all(f["recovered_s"] is not None for f in faults.values()), faults  # it went on
    assert "reclaimed by the other replica" in faults["rollout_replica_sigkill_reclaimed"]["detail"]
    assert faults["second_trainer_started"]["detail"].endswith("409")
    assert "the second trainer owns the run" in faults["trainer_sigterm_hand_off"]["detail"]
    assert result["completed"] and result["exactly_once"], result
    assert result["produced"] > 0 and result["lost"] == 0
    assert result["trained_twice"] == result["trained_and_dropped"] == 0
    assert result["accounted_beyond_produced"] == result["unexplained_drops"] == 0
    assert result["trained"] + sum(result["dropped"].values()) == result["produced"]
    assert result["resumed"] >= 2  # the SIGKILLed trainer's restart, and the hand-off
    assert result["reconnects"] >= 1  # `treadle run` lost its trainer and got back
    assert result["tracebacks_in_logs"] == {}, result["outputs"]
