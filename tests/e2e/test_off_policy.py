"""Off-policy correction on a real stack: `treadle run` of the skeleton recipe with rollout's
engine made to sample from a policy that is not the trainer's (`TREADLE_ROLLOUT_FAULT_LOGIT_
NOISE`), every service its own process. Whether `auto` recovers the learning the mismatch
costs is `treadle bench mismatch`'s question (a learning result: a bench, not a test)."""

import pytest

from tests.support.cli import run_recipe, run_rows
from tests.support.services import ROOT
from treadle_trainer import off_policy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SKELETON = ROOT / "recipes/skeleton.yaml"


def test_auto_measures_the_injected_mismatch_and_records_its_correction_every_step(
    cli_env, tmp_path
):
    env = {**cli_env, "TREADLE_ROLLOUT_FAULT_LOGIT_NOISE": "2.0"}
    overrides = {"trainer.loss": "ppo", "trainer.off_policy": "auto"}
    done = run_recipe(SKELETON, overrides, env, tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary, rows = run_rows(tmp_path)
    steps = [r for r in rows if r["kind"] == "step"]
    assert summary["state"] == "succeeded" and len(steps) == 3
    for s in steps:
        # the engine's bias shows as drift the trainer measures (a clean engine's is ~1e-6)
        assert s["log_ratio_p99"] > off_policy.TOLERANCE, s
        assert s["off_policy"] == "tis" and s["off_policy_cap"] in off_policy.CAPS, s
        assert off_policy.MIN_ESS <= s["off_policy_ess"] <= 1.0 or (
            s["off_policy_cap"] == off_policy.CAPS[0]
        ), s
        assert s["off_policy_masked"] == 0.0  # truncation zeroes no token
