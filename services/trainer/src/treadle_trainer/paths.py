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

from treadle_common.config.recipe import RunConfig
from treadle_trainer import errors
from treadle_trainer.backends import check_backend
from treadle_trainer.tracking.sinks import missing_library


def confine(path: str | Path, roots: Sequence[Path], what: str) -> Path:
    """`path` resolved, if inside one of `roots`; else HTTP 400 naming `what`."""
    resolved = Path(path).expanduser().resolve()
    if any(resolved.is_relative_to(root) for root in roots):
        return resolved
    allowed = ", ".join(str(r) for r in roots)
    raise errors.PathNotAllowed(
        f"{what} {str(path)!r} is outside the directories this trainer allows "
        f"({allowed}; TREADLE_TRAINER_PATH_ROOTS)",
    )


def check_config(config: RunConfig, roots: Sequence[Path]) -> None:
    """What a run's config may name: paths inside `roots` (HTTP 400) and a backend that can
    run it (422). Checked at a start and again at every resume from Redis."""
    if config.model.path is not None:
        confine(config.model.path, roots, "model.path")
    if config.data.path is not None:
        confine(config.data.path, roots, "data.path")
    confine(config.output_dir, roots, "output_dir")
    t = config.trainer
    try:
        check_backend(t.backend, t.tensor_parallel, t.pipeline_parallel, t.lora is not None)
    except ValueError as exc:
        raise errors.BackendRefused(f"trainer.backend: {exc}") from exc
    for spec in config.logging.trackers:
        if (library := missing_library(spec)) is not None:
            raise errors.TrackerUnavailable(
                f"logging.trackers: {spec.type} needs {library!r}, which this trainer lacks "
                "(pip install 'treadle-trainer[trackers]')"
            )
