"""One fixed batch through a backend: `python fsdp_worker.py MODEL OUT.json` (single process)
or under `torchrun --nproc-per-node 2` (FSDP2). Rank 0 writes the numbers to OUT.json.

Options: `--device cpu|cuda` (default: cuda when there is one), `--fp32` (no bf16 autocast on
GPU), `--fsdp` (FSDP2 even with one rank, e.g. NCCL on a single GPU).
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

from treadle_trainer.backends import AdamParams, BackendSpec, build_backend
from treadle_trainer.backends.fsdp import FSDPBackend, follow, shutdown_followers
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


def main(model_dir: str, out: str, device: str | None, bf16: bool, fsdp: bool) -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        follow()
        return
    spec = BackendSpec(model_dir=model_dir, seed=0, reference=True, device=device, bf16=bf16)
    backend = FSDPBackend.lead(spec) if fsdp else build_backend(spec)
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
                "device": backend.device,
                "dtypes": sorted({str(v.dtype) for v in state.values()}),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--device", default=None)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args(sys.argv[1:])
    main(args.model_dir, args.out, args.device, not args.fp32, args.fsdp)
