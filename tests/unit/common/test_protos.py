import subprocess
import sys
from pathlib import Path

import pytest

from treadle_common.proto.treadle.v1 import task_pb2, trajectory_pb2

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_match_the_protos():
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_trajectory_round_trips_per_token_versions_and_status():
    traj = trajectory_pb2.Trajectory(
        trajectory_id="t",
        tokens=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        token_versions=[-1, 4, 5],
        status=trajectory_pb2.TRAJECTORY_STATUS_ENV_ERROR,
        error="boom",
    )
    back = trajectory_pb2.Trajectory.FromString(traj.SerializeToString())
    assert list(back.token_versions) == [-1, 4, 5]
    assert back.status == trajectory_pb2.TRAJECTORY_STATUS_ENV_ERROR and back.error == "boom"
    assert task_pb2.Task(group_size=4).group_size == 4
