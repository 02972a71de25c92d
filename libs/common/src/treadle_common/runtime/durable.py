"""Files that survive a crash of the node, not only of the process.

A rename makes a file appear atomically, but without fsync its data (or the rename itself)
may still be in the page cache when the node dies: after a reboot the name can point to a
truncated file. So: write to a temp name, fsync the file, rename it into place, fsync the
directory; only then publish a pointer to it (a Redis key, a manifest). `digest` is the
file's xxh3-128, recorded beside it so a reader can tell a damaged file from a good one.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path

import xxhash

_BLOCK = 1 << 22


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not Linux
        return None


_SYNCFS = _load_syncfs()


def can_syncfs() -> bool:
    return _SYNCFS is not None


def syncfs(path: Path) -> None:
    """Flush everything written to the filesystem holding `path` (Linux `syncfs(2)`): one
    journal commit for many files, where an fsync of each costs one apiece."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here")
    fd = os.open(path, os.O_RDONLY)
    try:
        if _SYNCFS(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, `root` last."""
    dirs = []
    for here, _, files in os.walk(root):
        for name in files:
            fsync(Path(here) / name)
        dirs.append(Path(here))
    for directory in reversed(dirs):
        fsync(directory)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync(path.parent)


def digest(path: Path) -> str:
    """xxh3-128 of a file's bytes (hex)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()
