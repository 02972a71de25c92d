"""One fixed batch through a backend: `python fsdp_worker.py MODEL OUT.json` (single process)
or under `torchrun --nproc-per-node 2` (FSDP2). Rank 0 writes the numbers to OUT.json."""

import json
import os
import random
import sys
from pathlib import Path

from treadle_trainer.backends import AdamParams, BackendSpec, build_backend
from treadle_trainer.backends.fsdp import follow, shutdown_followers
from treadle_trainer.batches import Datum, pack
from treadle_trainer.losses import LossParams


def fixed_batch(vocab: int) -> list[Datum]:
    rng = random.Random(0)
    data = []
    for i in range(7):
        n = rng.randint(4, 20)
        ids = [rng.randrange(vocab) for _ in range(n + 1)]
        mask = [float(t >= n // 2) for t in range(n)]
        adv = rng.choice([-1.0, 0.5, 1.0])
        data.append(
            Datum(
                ids[:-1],
                ids[1:],
                mask,
                [adv * m for m in mask],
                [-rng.uniform(3, 8) * m for m in mask],
                group=str(i % 3),
            )
        )
    return data


def main(model_dir: str, out: str) -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        follow()
        return
    backend = build_backend(BackendSpec(model_dir=model_dir, seed=0, reference=True))
    mbs = pack(fixed_batch(backend.vocab_size), 40, "group", backend.pad_id)
    params = LossParams(kl_coef=0.1)
    backend.snapshot_proximal()  # pi_prox: the weights before this batch's updates
    first = backend.forward_backward(mbs, "decoupled_ppo", params)
    step = backend.optim_step(AdamParams(learning_rate=1e-3))
    second = backend.forward_backward(mbs, "ppo", params)
    backend.zero_grad()
    third = backend.forward_backward(mbs, "decoupled_ppo", params)  # a 2nd minibatch update
    backend.zero_grad()
    ckpt = Path(out).with_suffix(".ckpt")
    backend.save(ckpt, {"step": 1})
    meta = backend.load(ckpt)
    state = backend.state_dict_cpu()
    backend.close()
    shutdown_followers()
    Path(out).write_text(
        json.dumps(
            {
                "micro_batches": len(mbs),
                "first": first,
                "grad_norm": step["grad_norm"],
                "second": second,
                "third": third,
                "checksum": float(sum(v.double().abs().sum() for v in state.values())),
                "meta_step": meta["step"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
