"""`treadle_common.runtime.malloc`: freed chunk-sized buffers keep their pages for the next ones."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

PROBE = """
import resource, sys
from treadle_common.runtime.malloc import reuse_freed_memory
applied = reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def version():  # a received version: 64 messages of 4 MiB held at once, then dropped
    return [b"\\x01" * (4 << 20) for _ in range(64)]
held = version()
del held
before = faults()
held = version()
print(applied, faults() - before)
"""
PAGES = 64 * (4 << 20) // os.sysconf("SC_PAGE_SIZE")  # of one such version


def probe(**env: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_second_version_reuses_the_pages_of_the_first():
    applied, faults = probe()
    if not applied:
        pytest.skip("not glibc: mallopt is unavailable")
    assert faults < PAGES // 20, faults  # reused, not faulted in again


def test_tuning_off_keeps_the_defaults_which_fault_again():
    applied, faults = probe(TREADLE_MALLOC_TUNING="0")
    assert not applied
    if not probe()[0]:
        pytest.skip("not glibc: mallopt is unavailable")
    # glibc's defaults give the freed blocks back, so the second version faults its pages in
    # again; had the switch not turned the tuning off, this would be close to 0
    assert faults >= PAGES // 2, faults
