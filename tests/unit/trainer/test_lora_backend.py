"""`LoraBackend` (`trainer.lora`): only the adapter trains, the KL reference is the base model,
and a checkpoint restores the adapter and its Adam moments exactly."""

from __future__ import annotations

import pytest
import torch

from treadle_common.api.training import AdamParams
from treadle_trainer.backends import BackendSpec, build_backend
from treadle_trainer.backends.lora import LoraBackend
from treadle_trainer.batches import Datum, pack
from treadle_trainer.losses import LossParams

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from treadle_cli.tiny_model import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("lora-backend") / "tiny"))


def batch():
    data = [
        Datum([5, 6, 7, 8], [6, 7, 8, 9], [0.0, 1.0, 1.0, 1.0], [1.0] * 4, [-2.0] * 4, group="a"),
        Datum([9, 10, 11], [10, 11, 12], [1.0, 1.0, 1.0], [-1.0] * 3, [-2.0] * 3, group="a"),
    ]
    return pack(data, 4096, "token", pad_id=0)


def step(backend, loss="ppo", kl=0.0):
    out = backend.forward_backward(batch(), loss, LossParams(kl_coef=kl))
    backend.optim_step(AdamParams(learning_rate=1e-2))
    return out


def test_only_the_adapter_trains_and_the_base_is_the_reference(model_dir):
    backend = build_backend(BackendSpec(model_dir=model_dir, lora=LORA, reference=True))
    assert isinstance(backend, LoraBackend)
    base_before = {k: v.clone() for k, v in backend.base_state_cpu().items()}
    adapter = backend.state_dict_cpu()
    assert set(adapter) and all(k.endswith((".lora_A", ".lora_B")) for k in adapter)
    assert {k.rsplit(".", 2)[-2] for k in adapter} == set(LORA["targets"])
    first = step(backend, kl=0.1)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the policy is the base
    second = step(backend, kl=0.1)
    assert second["kl"] > 0  # the adapter moved away from the base
    after = backend.base_state_cpu()
    assert all(torch.equal(after[k], base_before[k]) for k in base_before)  # frozen
    now = backend.state_dict_cpu()
    assert any(not torch.equal(now[k], adapter[k]) for k in adapter)


def test_a_checkpoint_restores_adapter_and_moments(model_dir, tmp_path):
    a = build_backend(BackendSpec(model_dir=model_dir, lora=LORA))
    step(a)
    a.save(tmp_path / "ckpt", {"step": 1})
    b = build_backend(BackendSpec(model_dir=model_dir, lora=LORA, seed=7))
    b.load(tmp_path / "ckpt")
    state_a, state_b = a.state_dict_cpu(), b.state_dict_cpu()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    out_a, out_b = step(a), step(b)  # the same Adam moments: the same next step
    assert out_a["loss"] == pytest.approx(out_b["loss"], rel=1e-6)
    state_a, state_b = a.state_dict_cpu(), b.state_dict_cpu()
    assert all(torch.allclose(state_a[k], state_b[k], atol=1e-7) for k in state_a)
    # a full-weight checkpoint is refused by a LoRA backend (and the other way round)
    full = build_backend(BackendSpec(model_dir=model_dir))
    full.save(tmp_path / "full", {"step": 1})
    with pytest.raises(ValueError, match="different model|optimizer state"):
        b.load(tmp_path / "full")


def test_lora_is_refused_where_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="backend single"):
        build_backend(BackendSpec(model_dir=model_dir, lora=LORA, kind="fsdp"))
    tied = {**LORA, "targets": ["lm_head"]}
    with pytest.raises(ValueError, match="ties it"):
        build_backend(BackendSpec(model_dir=model_dir, lora=tied))


def test_runs_share_one_frozen_base_and_train_as_if_alone(model_dir):
    """Many runs, one trainer: LoRA backends of one model directory share its frozen base
    (one copy), and a run's adapter after steps interleaved with another run's equals the
    same steps taken with no other run; closing releases the base."""
    from treadle_trainer.backends.lora import SHARED_BASES

    alone = build_backend(BackendSpec(model_dir=model_dir, lora=LORA, seed=3))
    step(alone)
    step(alone)
    expected = alone.state_dict_cpu()
    alone.close()
    a = build_backend(BackendSpec(model_dir=model_dir, lora=LORA, seed=3))
    users = SHARED_BASES.users(a._key)  # (earlier tests' backends, never closed, count too)
    b = build_backend(BackendSpec(model_dir=model_dir, lora={**LORA, "rank": 2}, seed=4))
    assert a.base is b.base and a.layout_info()["base_shared_by"] == users + 1
    base_before = {k: v.clone() for k, v in a.base_state_cpu().items()}
    for _ in range(2):
        step(a)
        step(b, loss="importance_sampling")
    got = a.state_dict_cpu()
    assert set(got) == set(expected)
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in expected)
    assert any(not torch.equal(v, 0 * v) for v in b.state_dict_cpu().values())
    assert all(torch.equal(v, base_before[k]) for k, v in b.base_state_cpu().items())
    key = a._key
    a.close()
    assert SHARED_BASES.users(key) == users
    b.close()
    assert SHARED_BASES.users(key) == users - 1


def test_runs_train_side_by_side_on_torch_lanes_as_if_alone(model_dir):
    """`trainer_torch_lanes` 2: two runs' steps on two threads at once over the shared base
    (each selects its adapter in its own thread's context) end where each alone would."""
    from concurrent.futures import ThreadPoolExecutor

    expected = []
    for seed, rank in ((5, 4), (6, 2)):
        alone = build_backend(
            BackendSpec(model_dir=model_dir, lora={**LORA, "rank": rank}, seed=seed)
        )
        for _ in range(3):
            step(alone)
        expected.append(alone.state_dict_cpu())
        alone.close()
    a = build_backend(BackendSpec(model_dir=model_dir, lora=LORA, seed=5))
    b = build_backend(BackendSpec(model_dir=model_dir, lora={**LORA, "rank": 2}, seed=6))

    def three(backend) -> None:
        for _ in range(3):
            step(backend)

    with ThreadPoolExecutor(2) as lanes:
        list(lanes.map(three, [a, b]))
    for backend, want in zip((a, b), expected, strict=True):
        got = backend.state_dict_cpu()
        assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
    a.close()
    b.close()
