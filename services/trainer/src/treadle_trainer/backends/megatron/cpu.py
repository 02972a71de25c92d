"""What megatron-core needs to run on CPU torch over gloo; used only when CUDA is absent.

megatron-core 0.16 assumes a GPU in two places a CPU run reaches:
- `torch.cuda.current_device()` names the device of buffers it allocates (about 40 calls):
  on CPU it answers `cpu`;
- the CUDA RNG tracker that model-parallel dropout forks: the inference tracker (no
  per-region CUDA state) stands in.
Its optimizer and gradient clipping assume CUDA tensors too; the backend uses torch's AdamW
and its own clipping instead. Sequence parallel needs Apex/TE norms: off on CPU.
On a GPU nothing here runs.
"""

from __future__ import annotations

import torch

_patched = False


def patch_for_cpu() -> None:
    """Idempotent; a no-op where CUDA is available."""
    global _patched
    if _patched or torch.cuda.is_available():
        return
    # megatron-core passes the answer as `device=`: "cpu" is as good as an index there
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    _patched = True


def init_rng_tracker() -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(
        inference_rng_tracker=not torch.cuda.is_available()
    )
