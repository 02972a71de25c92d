"""Which failed episodes count against their env's circuit breaker."""

import pytest

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.failures import FAILED, env_failed

pytestmark = pytest.mark.unit


def _traj(status: int, error: str = "") -> tpb.Trajectory:
    return tpb.Trajectory(status=status, error=error)  # type: ignore[arg-type]


def test_only_the_envs_own_failures_count_against_it():
    env_raised = _traj(tpb.TRAJECTORY_STATUS_ENV_ERROR, "env arith raised: KeyError")
    sandbox = _traj(tpb.TRAJECTORY_STATUS_SANDBOX_ERROR, "sandbox failed: no bwrap")
    crashed = _traj(tpb.TRAJECTORY_STATUS_ENV_ERROR, "env-gateway: INTERNAL: env failed to reset")
    assert env_failed(env_raised) and env_failed(sandbox) and env_failed(crashed)
    # an outage, the engine and the scorer are retried too, but do not break the env
    away = _traj(tpb.TRAJECTORY_STATUS_ENV_ERROR, "env-gateway unreachable: UNAVAILABLE: down")
    engine = _traj(tpb.TRAJECTORY_STATUS_ENGINE_ERROR, "engine failed")
    scorer = _traj(tpb.TRAJECTORY_STATUS_REWARD_ERROR, "reward TIMEOUT")
    assert not any(env_failed(t) for t in (away, engine, scorer))
    assert all(t.status in FAILED for t in (away, engine, scorer, env_raised, sandbox))
    assert not env_failed(_traj(tpb.TRAJECTORY_STATUS_OK))
    assert tpb.TRAJECTORY_STATUS_TRUNCATED not in FAILED  # scored: trained
