"""One fixed batch through a backend: `python fsdp_worker.py MODEL OUT.json` (single process)
or under `torchrun --nproc-per-node 2` (FSDP2). Rank 0 writes the numbers to OUT.json.

Options: `--device cpu|cuda` (default: cuda when there is one), `--fp32` (no bf16 autocast on
GPU), `--fsdp` (FSDP2 even with one rank, e.g. NCCL on a single GPU), `--megatron TP` (the
megatron-core backend with TP tensor-parallel ranks), `--weights FILE` (the final weights, HF
layout, as safetensors).
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from treadle_trainer.backends import AdamParams, BackendSpec, build_backend
from treadle_trainer.backends.follower import follow
from treadle_trainer.backends.fsdp import FSDPBackend
from treadle_trainer.backends.group import leave
from treadle_trainer.backends.ranks import shutdown_followers
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


def main(args: argparse.Namespace) -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        follow()
        return
    spec = BackendSpec(
        model_dir=args.model_dir, seed=0, reference=True, device=args.device, bf16=not args.fp32
    )
    if args.megatron:
        spec = spec.model_copy(update={"kind": "megatron", "tensor_parallel": args.megatron})
    backend = FSDPBackend.lead(spec) if args.fsdp else build_backend(spec)
    mbs = pack(fixed_batch(backend.vocab_size), 40, "group", backend.pad_id)
    params = LossParams(kl_coef=0.1)
    backend.snapshot_proximal()  # pi_prox: the weights before this batch's updates
    first = backend.forward_backward(mbs, "decoupled_ppo", params)
    step = backend.optim_step(AdamParams(learning_rate=1e-3))
    second = backend.forward_backward(mbs, "ppo", params)
    backend.zero_grad()
    third = backend.forward_backward(mbs, "decoupled_ppo", params)  # a 2nd minibatch update
    backend.zero_grad()
    stepped = backend.snapshot_cpu()  # after the first update (a copy)
    ckpt = Path(args.out).with_suffix(".ckpt")
    backend.save(ckpt, {"step": 1})
    meta = backend.load(ckpt)
    state = backend.snapshot_cpu()
    restored = all(torch.equal(state[k], stepped[k]) for k in stepped)
    # a step after the restore: equal across backends only if the Adam moments came back
    backend.forward_backward(mbs, "ppo", params)
    resumed_step = backend.optim_step(AdamParams(learning_rate=1e-3))
    resumed = backend.state_dict_cpu()
    backend.close()
    shutdown_followers()
    if args.weights:
        save_file({k: v.clone() for k, v in stepped.items()}, args.weights)
        save_file({k: v.clone() for k, v in resumed.items()}, args.weights + ".resumed")
    Path(args.out).write_text(
        json.dumps(
            {
                "micro_batches": len(mbs),
                "first": first,
                "grad_norm": step["grad_norm"],
                "second": second,
                "third": third,
                "checksum": float(sum(v.double().abs().sum() for v in state.values())),
                "meta_step": meta["step"],
                "restored_identical": restored,
                "resumed_grad_norm": resumed_step["grad_norm"],
                "device": backend.device,
                "dtypes": sorted({str(v.dtype) for v in state.values()}),
                # the single backend hands CUDA weights over in pinned memory (host_copy.py)
                "snapshot_pinned": torch.cuda.is_available()
                and all(v.is_pinned() for v in stepped.values()),
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
    parser.add_argument("--megatron", type=int, default=0, metavar="TP")
    parser.add_argument("--weights", default=None)
    main(parser.parse_args(sys.argv[1:]))
    if "RANK" in os.environ:  # under torchrun: see `leave`
        leave(0)
