"""`SharedPrefix`: a GRPO batch's prompt runs once per distinct prompt and the output head
only where a loss looks, with the same log-probabilities, entropies and gradients as the
whole rows (full weights and a LoRA adapter)."""

from __future__ import annotations

import random

import pytest
import torch

from treadle_trainer.backends import BackendSpec, build_backend
from treadle_trainer.backends.logprobs import SharedPrefix, token_logprobs
from treadle_trainer.batches import Datum, pack
from treadle_trainer.losses import LossParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from treadle_cli.tiny_model import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("shared-prefix") / "tiny"))


def groups(rng: random.Random, n_groups: int = 3, size: int = 4) -> list[Datum]:
    """GRPO-shaped data: each group one prompt (lengths differ across groups), `size`
    completions of different lengths; the loss covers the completions only."""
    data = []
    for g in range(n_groups):
        prompt = [rng.randrange(5, 200) for _ in range(rng.randint(6, 9))]
        for _ in range(size):
            completion = [rng.randrange(5, 200) for _ in range(rng.randint(1, 4))]
            ids = prompt + completion
            weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(completion) + 1)
            data.append(
                Datum(
                    ids,
                    ids[1:] + [2],
                    weights,
                    [rng.gauss(0, 1) * w for w in weights],
                    [-1.5 * w for w in weights],
                    group=str(g),
                )  # fmt: skip
            )
    return data


def grads_and_values(backend, mb, loss_columns: bool):
    backend.zero_grad()
    lp, ent = token_logprobs(
        backend.model, mb, "cpu", entropy=True, temperature=0.7, loss_columns=loss_columns
    )
    (lp * mb.mask_B_T * mb.advantages_B_T).sum().backward()
    params = [p for p in backend.model.parameters() if p.grad is not None] or backend.params
    return lp * mb.mask_B_T, ent * mb.mask_B_T, [p.grad.clone() for p in params]


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}])
def test_shared_prefix_gives_the_whole_rows_values_and_gradients(model_dir, lora):
    backend = build_backend(BackendSpec(model_dir=model_dir, lora=lora, seed=3))
    if lora is not None:  # a non-zero adapter, so its gradients flow through the prefix
        with torch.no_grad():
            for p in backend.params:
                p.add_(0.05 * torch.randn_like(p))
    (mb,) = pack(groups(random.Random(0)), 10**6, "token", backend.pad_id)
    plan = SharedPrefix.of(backend.model, mb)
    assert plan is not None and plan.unique is not None
    assert len(plan.unique) == 3 < mb.input_ids_B_T.shape[0]  # one prefix per group
    assert len(plan.cols) < mb.input_ids_B_T.shape[1]
    whole, shared = grads_and_values(backend, mb, False), grads_and_values(backend, mb, True)
    torch.testing.assert_close(shared[0], whole[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shared[1], whole[1], atol=1e-5, rtol=1e-4)
    assert len(shared[2]) == len(whole[2]) > 0
    for a, b in zip(shared[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
    # a training step reports the same statistics either way
    stats = backend.forward_backward([mb], "ppo", LossParams())
    assert stats["num_tokens"] == float(mb.mask_B_T.sum())


def test_nothing_shared_or_no_loss_columns_take_the_plain_path(model_dir):
    backend = build_backend(BackendSpec(model_dir=model_dir))
    rng = random.Random(1)
    distinct = [
        Datum(ids, ids[1:] + [2], [0.0] * 5 + [1.0] * 3, [1.0] * 8, [-1.0] * 8, group=str(i))
        for i, ids in enumerate([[rng.randrange(5, 200) for _ in range(8)] for _ in range(4)])
    ]
    (mb,) = pack(distinct, 10**6, "token", backend.pad_id)
    plan = SharedPrefix.of(backend.model, mb)
    assert plan is not None and plan.unique is None  # only the output head is cut
    whole, cut = grads_and_values(backend, mb, False), grads_and_values(backend, mb, True)
    torch.testing.assert_close(cut[0], whole[0], atol=1e-5, rtol=1e-4)
    everywhere = [Datum([5, 6, 7], [6, 7, 8], [1.0] * 3, [1.0] * 3, [-1.0] * 3, group="a")]
    (mb,) = pack(everywhere, 10**6, "token", backend.pad_id)
    assert SharedPrefix.of(backend.model, mb) is None
