"""Client-named server paths, confined to the directories the trainer allows.

A recipe's `model.path`, `data.path` and `output_dir`, and the training API's `model_path`
and `load_state` path, name files on the trainer's machine: each must resolve (symlinks and
`..` followed) inside one of `TrainerSettings.path_roots()`, or the request is refused with
a 400 that names the field. The trainer never reads or writes (nor `rmtree`s) elsewhere
for a client.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fastapi import HTTPException


def confine(path: str | Path, roots: Sequence[Path], what: str) -> Path:
    """`path` resolved, if inside one of `roots`; else HTTP 400 naming `what`."""
    resolved = Path(path).expanduser().resolve()
    if any(resolved.is_relative_to(root) for root in roots):
        return resolved
    allowed = ", ".join(str(r) for r in roots)
    raise HTTPException(
        400,
        f"{what} {str(path)!r} is outside the directories this trainer allows "
        f"({allowed}; TREADLE_TRAINER_PATH_ROOTS)",
    )
