"""The real `treadle` command, run as a user runs it."""

import subprocess
import sys
from pathlib import Path

TREADLE = str(Path(sys.executable).parent / "treadle")


def treadle(*args: str, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TREADLE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
