"""The megatron-core trainer backend (`trainer.backend: megatron`).

weights.py  HF <-> megatron-core tensors: fused QKV, gate/up, TP split and merge
model.py    a `GPTModel` for an HF config; vocab-parallel logprobs and entropy
cpu.py      the shims megatron-core needs on CPU torch over gloo (only without CUDA)
backend.py  `MegatronBackend`: the trainer's backend API over the TP x PP x DP grid
"""

from treadle_trainer.backends.megatron.cpu import stand_in_for_triton_kernels

stand_in_for_triton_kernels()  # before anything here imports megatron.core

from treadle_trainer.backends.megatron.backend import MegatronBackend  # noqa: E402

__all__ = ["MegatronBackend"]
