import pytest
import torch

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_trainer.batches import drop_reason, grpo_advantages, staleness, to_tensors
from treadle_trainer.losses import policy_gradient

pytestmark = pytest.mark.unit


def traj(
    group: str, reward: float, versions=(3, 3), status=tpb.TRAJECTORY_STATUS_OK
) -> tpb.Trajectory:
    return tpb.Trajectory(
        group_id=group,
        reward=reward,
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        token_versions=[-1, *versions],
        status=status,
    )


def test_grpo_advantages_by_hand():
    trajs = [traj("g", 1.0), traj("g", 0.0), traj("h", 0.5), traj("h", 0.5)]
    adv = grpo_advantages(trajs)
    # group g: mean 0.5, population std 0.5 -> +1, -1 ; group h: constant -> 0
    assert adv == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_policy_gradient_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    # -(1*(-1) + 1*(-2) + (-2)*(-0.5)) / 3 = -(-1 - 2 + 1) / 3 = 2/3
    assert policy_gradient(logprobs, adv, mask).item() == pytest.approx(2 / 3)


def test_staleness_uses_the_oldest_generated_token():
    assert staleness(traj("g", 0, versions=(2, 4)), trainer_version=5) == 3


def test_drop_reasons():
    assert drop_reason(traj("g", 0, versions=(1, 1)), 3, max_staleness=1) == "stale"
    assert (
        drop_reason(traj("g", 0, status=tpb.TRAJECTORY_STATUS_REWARD_ERROR), 3, 1) == "reward_error"
    )
    assert drop_reason(traj("g", 0), 3, 0) is None


def test_to_tensors_shifts_and_masks():
    batch = to_tensors(
        [traj("g", 1.0), tpb.Trajectory(tokens=[1, 2], loss_mask=[0, 1])], [0.5, -0.5], pad_id=0
    )
    assert batch.input_ids_B_T.tolist() == [[5, 6], [1, 0]]
    assert batch.targets_B_T.tolist() == [[6, 7], [2, 0]]
    assert batch.mask_B_T.tolist() == [[1.0, 1.0], [1.0, 0.0]]
