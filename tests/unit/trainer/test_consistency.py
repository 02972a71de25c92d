"""Train-inference consistency per step (`consistency.py`): the log ratio d = log p_trainer -
log p_behaviour of every loss token, summed per batch and joined across minibatches; a real
backend's step reports d = 0 for on-policy data and the shift a perturbed behaviour put in."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.drift import on_policy_data
from treadle_common.api.runs import RATIO_EDGES, StepRecord
from treadle_trainer import consistency
from treadle_trainer.backends import BackendSpec, build_backend
from treadle_trainer.batches import pack
from treadle_trainer.losses import LossParams

pytestmark = pytest.mark.unit


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_drift_figures_by_hand():
    d = torch.tensor([[0.0, 0.5, -0.25, 9.0]])
    weight = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is not a loss token
    drift = consistency.Drift()
    drift.add(d, torch.zeros_like(d), weight)
    out = drift.summary(identity, identity)
    kept = [0.0, 0.5, -0.25]
    assert out["log_ratio_mean"] == pytest.approx(sum(kept) / 3)
    assert out["log_ratio_abs_mean"] == pytest.approx(0.75 / 3)
    assert out["log_ratio_max"] == pytest.approx(0.5)
    assert out["behaviour_kl"] == pytest.approx(sum(math.expm1(x) - x for x in kept) / 3)
    assert sum(out["ratio_histogram"]) == 3 and len(out["ratio_histogram"]) == len(RATIO_EDGES) + 1
    for x in kept:
        assert out["ratio_histogram"][consistency.ratio_bin(x)] >= 1
    assert out["ratio_histogram"][consistency.ratio_bin(0.0)] == 1  # -0.001 <= 0 < 0.001
    # the p99 of |d| is the upper edge of the bin 0.5 falls in, never above the largest |d|
    assert 0.25 < out["log_ratio_p99"] <= 0.5
    assert consistency.Drift().summary(identity, identity) == {}  # no loss token: nothing


def test_minibatches_join_into_one_steps_figures():
    a, b = consistency.Drift(), consistency.Drift()
    a.add(torch.tensor([[0.1, 0.1]]), torch.zeros(1, 2), torch.ones(1, 2))
    b.add(torch.tensor([[-0.4, 0.0, 0.0, 0.0]]), torch.zeros(1, 4), torch.ones(1, 4))
    whole = consistency.Drift()
    whole.add(torch.tensor([[0.1, 0.1, -0.4, 0.0, 0.0, 0.0]]), torch.zeros(1, 6), torch.ones(1, 6))
    merged = consistency.merge([a.summary(identity, identity), b.summary(identity, identity)])
    want = whole.summary(identity, identity)
    assert merged["ratio_histogram"] == want["ratio_histogram"]
    for key in ("log_ratio_mean", "log_ratio_abs_mean", "behaviour_kl", "log_ratio_p99"):
        assert merged[key] == pytest.approx(want[key]), key
    assert merged["log_ratio_max"] == pytest.approx(0.4)
    assert merged["drift_by_staleness"] == pytest.approx(want["drift_by_staleness"])
    assert consistency.staleness_histogram([0, 2, 0, 1, 0]) == [3, 1, 1]


def test_the_drift_is_split_by_how_many_versions_behind_each_sequence_was():
    """Sequence 0 is fresh (|d| 0.1), sequence 1 two versions behind (|d| 0.5 and 0.3),
    sequence 2 nine behind (the last bucket): none is one behind."""
    d = torch.tensor([[0.1, 0.0], [0.5, -0.3], [2.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    drift = consistency.Drift()
    drift.add(d, torch.zeros_like(d), weight, torch.tensor([0, 2, 9]))
    by = drift.summary(identity, identity)["drift_by_staleness"]
    buckets = consistency.STALE_BUCKETS
    assert by[:3] == pytest.approx([0.1, 0.0, 0.4]) and len(by) == buckets
    assert by[buckets - 1] == pytest.approx(2.0)
    fresh = consistency.Drift()
    fresh.add(d, torch.zeros_like(d), weight)  # no staleness given: all fresh
    assert fresh.summary(identity, identity)["drift_by_staleness"] == pytest.approx([2.9 / 4])
    assert consistency.staleness_histogram([]) == []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from treadle_cli.tiny_model import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("consistency") / "tiny"))


@pytest.mark.parametrize("shift", [0.0, 0.3])
def test_a_backends_step_reports_the_drift_its_behaviour_logprobs_carry(model_dir, shift):
    backend = build_backend(BackendSpec(model_dir=model_dir))
    data = on_policy_data(backend, random.Random(0), shift)
    data[3].staleness = 3  # generated three versions ago: its drift is reported apart
    mbs = pack(data, 4096, "token", backend.pad_id)
    out = backend.forward_backward(mbs, "ppo", LossParams())
    assert out["drift_by_staleness"] == pytest.approx([shift, 0.0, 0.0, shift], abs=1e-4)
    assert sum(out["ratio_histogram"]) == out["num_tokens"] == 12
    assert out["log_ratio_mean"] == pytest.approx(shift, abs=1e-4)
    assert out["log_ratio_max"] == pytest.approx(shift, abs=1e-4)
    assert out["behaviour_kl"] == pytest.approx(math.expm1(shift) - shift, abs=1e-4)
    assert out["ratio_histogram"][consistency.ratio_bin(shift)] == 12
    # a step's record keeps them (`step_record` passes every StepRecord field of the stats)
    fields = {k: v for k, v in out.items() if k in StepRecord.model_fields and k != "loss"}
    record = StepRecord(
        step=1, version=1, mean_reward=0.0, num_trajectories=4, max_staleness=0, loss=0.0,
        grad_norm=0.0, publish_s=0.0, published=True, duration_s=1.0, **fields,
    )  # fmt: skip
    assert record.ratio_histogram == out["ratio_histogram"]
    assert record.drift_by_staleness == out["drift_by_staleness"]
    assert record.log_ratio_p99 == pytest.approx(shift, abs=1e-4) or shift == 0.0
    backend.close()
