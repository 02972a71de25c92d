"""A backend checkpoint's files, and the check that they are whole before anything loads them
(the directory layout: `single.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treadle_common.runtime import durable
from treadle_trainer.errors import CorruptCheckpoint

CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.safetensors")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's meta, once every file it lists has its recorded size and digest."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"checkpoint {path}: meta.json unreadable: {exc}") from exc
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(CHECKPOINT_FILES):
        raise CorruptCheckpoint(f"checkpoint {path}: meta.json lists no file digests")
    for name, want in files.items():
        file = path / name
        size = file.stat().st_size if file.exists() else -1
        if size != want["size"] or durable.digest(file) != want["xxh3"]:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name} is damaged ({size} bytes, {want['size']} recorded)"
            )
    return meta
