"""The snapshot a step hands to the publisher: a contiguous host copy that later optimizer
steps leave alone (on the CPU here; `tests/gpu/test_cuda.py` checks the pinned CUDA path)."""

import pytest
import torch

from treadle_trainer.backends import build_backend
from treadle_trainer.backends.host_copy import snapshot
from treadle_trainer.public import AdamParams, BackendSpec

pytestmark = pytest.mark.unit


def test_a_snapshot_is_a_contiguous_copy():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"weight": weight, "transposed": weight.t(), "bias": torch.ones(3)}
    copy = snapshot(state)
    assert list(copy) == list(state)
    for name, tensor in state.items():
        assert torch.equal(copy[name], tensor) and copy[name].is_contiguous()
        assert copy[name].data_ptr() != tensor.data_ptr()
    weight.add_(1.0)  # an optimizer step after the handover
    assert torch.equal(copy["weight"], torch.arange(12.0).reshape(3, 4))


def test_the_backend_snapshot_keeps_the_weights_of_its_step(tmp_path):
    from treadle_cli.tiny_model import init_tiny

    backend = build_backend(BackendSpec(model_dir=str(init_tiny(tmp_path / "tiny")), seed=0))
    handed = backend.snapshot_cpu()
    kept = {k: v.clone() for k, v in handed.items()}
    assert handed.keys() == backend.state_dict_cpu().keys()
    for parameter in backend.model.parameters():  # an optimizer step after the handover
        parameter.grad = torch.ones_like(parameter)
    backend.optim_step(AdamParams(learning_rate=1e-2))
    stepped = backend.state_dict_cpu()
    assert any(not torch.equal(handed[k], stepped[k]) for k in stepped)
    assert all(torch.equal(handed[k], kept[k]) for k in kept)
    backend.close()
