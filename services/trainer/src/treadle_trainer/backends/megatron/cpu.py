"""What megatron-core needs to run on CPU torch over gloo; used only when CUDA is absent.

megatron-core 0.19 imports Triton, a GPU kernel compiler, unconditionally in one place:
`megatron.core` → pipeline schedules → the MoE paged stash → its Triton kernels. CUDA builds
of torch bring Triton; the CPU build does not, and Triton's wheel is a gigabyte. Where
Triton is absent, that kernels module is a stand-in (`stand_in_for_triton_kernels`) whose
kernels raise when launched; a CPU run never launches them (no MoE, no CUDA graphs).
megatron-core assumes a GPU in two more places a CPU run reaches:
- `torch.cuda.current_device()` names the device of buffers it allocates (about 40 calls):
  on CPU it answers `cpu`;
- the CUDA RNG tracker that model-parallel dropout forks: the inference tracker (no
  per-region CUDA state) stands in.
Its optimizer and gradient clipping assume CUDA tensors too; the backend uses torch's AdamW
and its own clipping instead. Sequence parallel needs Apex/TE norms: off on CPU.
On a GPU nothing here runs.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

_patched = False
PAGED_STASH_KERNELS = "megatron.core.transformer.moe.ops.paged_stash"


def stand_in_for_triton_kernels() -> None:
    """Before megatron-core is imported: where Triton is not installed, register the MoE
    paged-stash kernels module as one whose kernels raise. Idempotent."""
    if PAGED_STASH_KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    class _Kernel:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid: object) -> _Kernel:
            return self

        def __call__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError(f"megatron-core's Triton kernel {self.name} needs triton and a GPU")

    module = types.ModuleType(PAGED_STASH_KERNELS, "stand-in: Triton is not installed")
    module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]  # megatron-core 0.19's
    for name in ("paged_stash_copy_kernel", "paged_stash_pop_kernel"):
        setattr(module, name, _Kernel(name))
    sys.modules[PAGED_STASH_KERNELS] = module


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
