"""megatron-core 0.19 imports Triton (its MoE paged-stash kernels) on every `import
megatron.core`; the CPU build of torch has no Triton. The backend package stands in for that
one kernels module, so megatron-core imports, and a launch of one of its kernels says why
it cannot run."""

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None, reason="Triton is installed: no stand-in"
)

PROBE = """
import importlib.metadata, sys
import treadle_trainer.backends.megatron
from megatron.core import parallel_state
from megatron.core.transformer.moe.paged_stash import paged_stash_copy_kernel
print(importlib.metadata.version("megatron-core"), "triton" in sys.modules)
try:
    paged_stash_copy_kernel[(1,)](None)
except RuntimeError as exc:
    print(exc)
"""


def test_megatron_core_imports_without_triton_and_its_kernels_refuse_to_launch():
    # a fresh interpreter: megatron.core must not have been imported before the package
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "0.19.2 False"
    assert out[1] == "megatron-core's Triton kernel paged_stash_copy_kernel needs triton and a GPU"


def test_without_the_stand_in_megatron_core_needs_triton():
    """What the stand-in is for (fails, and the stand-in can go, once megatron-core stops
    importing Triton unconditionally)."""
    probe = "import megatron.core"
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True)
    assert run.returncode != 0 and b"No module named 'triton'" in run.stderr
