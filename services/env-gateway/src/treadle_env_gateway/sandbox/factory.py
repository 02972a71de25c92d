"""The one place a sandbox backend is chosen by name (`TREADLE_ENV_SANDBOX`): the
interface every backend implements lives in `backends.py`, the backends in `local.py`
(unshare, bwrap) and `docker.py`."""

from __future__ import annotations

from pathlib import Path

from treadle_env_gateway.sandbox.backends import BACKENDS, Backend
from treadle_env_gateway.sandbox.docker import DockerBackend
from treadle_env_gateway.sandbox.local import BwrapBackend, UnshareBackend


def make_backend(
    name: str, base_dir: Path, image: str = "python:3.11-slim-bookworm", python: str | None = None
) -> Backend:
    if name == "unshare":
        return UnshareBackend(base_dir, python)
    if name == "bwrap":
        return BwrapBackend(base_dir, python)
    if name == "docker":
        return DockerBackend(image)
    raise ValueError(f"unknown sandbox backend {name!r} (one of {', '.join(BACKENDS)})")
