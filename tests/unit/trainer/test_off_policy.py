"""Off-policy corrections (`off_policy.py`): each mode's token weights by hand, auto's choice
from the measured drift, and a real backend's step that applies and reports them."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.drift import on_policy_data
from treadle_trainer import off_policy
from treadle_trainer.backends import BackendSpec, build_backend
from treadle_trainer.batches import pack
from treadle_trainer.losses import LossParams

pytestmark = pytest.mark.unit


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_each_modes_weights_by_hand():
    log_rho = torch.tensor([[0.0, math.log(3.0), math.log(0.25)], [0.1, 0.1, 0.1]])
    prox, behaviour = log_rho, torch.zeros_like(log_rho)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tis = off_policy.Correction("tis", 2.0).weights(prox, behaviour, mask)
    assert tis.tolist()[0] == pytest.approx([1.0, 2.0, 0.25])  # truncated at the cap only
    mis = off_policy.Correction("mis", 2.0).weights(prox, behaviour, mask)
    assert mis.tolist()[0] == pytest.approx([1.0, 0.0, 0.0])  # outside [1/2, 2]: masked
    assert mis.tolist()[1] == pytest.approx([math.exp(0.1)] * 3)
    seq = off_policy.Correction("seq_mis", 2.0).weights(prox, behaviour, mask)
    # sequence 0's mean log rho: (log 3 + log 0.25) / 3 = -0.1 -> kept, tokens truncated
    assert seq.tolist()[0] == pytest.approx([1.0, 2.0, 0.25])
    far = off_policy.Correction("seq_mis", 2.0).weights(prox + 1.0, behaviour, mask)
    assert far.tolist()[1] == [0.0, 0.0, 0.0]  # geometric mean e^1.1 > 2: the whole sequence


def test_a_named_mode_needs_no_measuring_and_cross_entropy_is_never_corrected():
    assert off_policy.fixed("tis", 3.0, "ppo") == off_policy.Correction("tis", 3.0)
    assert off_policy.fixed("auto", 3.0, "ppo") is None
    assert not off_policy.fixed("tis", 3.0, "cross_entropy").active
    assert not off_policy.fixed("none", 3.0, "ppo").active


def measured(log_rho: list[float]) -> off_policy.Correction:
    m = off_policy.Measure()
    d = torch.tensor([log_rho])
    m.add(d, torch.zeros_like(d), torch.ones_like(d))
    return m.decide(identity, identity)


def test_auto_leaves_agreement_alone_and_caps_drift_by_effective_sample_size():
    assert measured([0.0] * 50 + [0.01] * 50) == off_policy.Correction("none")
    # a constant ratio: every cap keeps all the sample, so the largest
    assert measured([0.3] * 100) == off_policy.Correction("tis", off_policy.CAPS[-1])
    # 98 tokens at rho 0.61, 2 at rho 20: ESS 0.95 (cap 1.5), 0.91, 0.79, 0.56 (cap 5), 0.27
    assert measured([-0.5] * 98 + [3.0] * 2) == off_policy.Correction("tis", 5.0)
    # one huge weight: even the smallest cap leaves less than MIN_ESS; auto still truncates
    assert measured([-6.0] * 99 + [6.0]).cap == off_policy.CAPS[0]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from treadle_cli.tiny_model import init_tiny

    model_dir = str(init_tiny(tmp_path_factory.mktemp("off-policy") / "tiny"))
    backend = build_backend(BackendSpec(model_dir=model_dir))
    yield backend
    backend.close()


def step(backend, shift: float, **params) -> dict:
    data = on_policy_data(backend, random.Random(0), shift)
    mbs = pack(data, 4096, "token", backend.pad_id)
    out = backend.forward_backward(mbs, "ppo", LossParams(**params))
    backend.zero_grad()
    return out


def test_a_backends_step_applies_the_correction_and_reports_it(backend):
    """A behaviour `shift` lower than the trainer everywhere: rho = e^shift on every token.
    tis centres the ratio on the trainer's policy and weighs each token by rho, so its loss
    is rho times the on-policy loss; uncorrected, the ratio e^shift is clipped."""
    clean = step(backend, 0.0)
    assert clean["off_policy"] == "none" and clean["off_policy_ess"] == 1.0
    shift = 0.3
    tis = step(backend, shift, off_policy="tis", is_cap=2.0)
    assert tis["loss"] == pytest.approx(math.exp(shift) * clean["loss"], rel=1e-4)
    assert (tis["off_policy"], tis["off_policy_cap"]) == ("tis", 2.0)
    assert tis["off_policy_ess"] == pytest.approx(1.0) and tis["off_policy_masked"] == 0.0
    assert tis["log_ratio_mean"] == pytest.approx(shift, abs=1e-4)  # the drift: still mu's
    none = step(backend, shift)
    assert none["clip_fraction"] == pytest.approx(1.0)  # e^0.3 > 1.28 on every token
    capped = step(backend, 1.0, off_policy="tis", is_cap=2.0)
    assert capped["loss"] == pytest.approx(2.0 * clean["loss"], rel=1e-4)
    masked = step(backend, 1.0, off_policy="mis", is_cap=2.0)  # e^1 outside [1/2, 2]
    assert masked["off_policy_masked"] == pytest.approx(1.0) and masked["loss"] == 0.0
    assert step(backend, 0.0, off_policy="auto")["off_policy"] == "none"
    auto = step(backend, shift, off_policy="auto")
    assert (auto["off_policy"], auto["off_policy_cap"]) == ("tis", off_policy.CAPS[-1])
    assert auto["loss"] == pytest.approx(tis["loss"], rel=1e-4)
