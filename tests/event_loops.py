"""Which event loop a running process is on, seen from outside it."""

from __future__ import annotations

from pathlib import Path


def uses_uvloop(pid: int) -> bool:
    """uvloop's extension is mapped into `pid` (a process on asyncio's loop never imports
    it: nothing else in Treadle does)."""
    return "/uvloop/loop." in Path(f"/proc/{pid}/maps").read_text()
