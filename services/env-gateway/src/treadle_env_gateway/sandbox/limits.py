"""What a sandboxed run may use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    max_processes: int = 32
    max_file_bytes: int = 16 * 2**20
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024
    disk_bytes: int = 64 * 2**20
    """The whole work dir: a tmpfs of this size (a full one is the code's ENOSPC)."""
