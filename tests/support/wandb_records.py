"""The records of an offline W&B run (`run-<id>.wandb`), parsed by W&B's own protobuf schema
(`wandb.proto.wandb_internal_pb2.Record`). wandb 0.31 ships no Python reader of its
transaction log, so the framing is read here: LevelDB's log format behind a 7-byte header
(`:W&B`, magic 0xBEE1, version 0), records in 32 KiB blocks, each `crc32c (4) | length (2,
little-endian) | type (1: full, 2: first, 3: middle, 4: last)` then its bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Imported here, at collection, not when a test first reads a log: wandb's import builds a
# pydantic model whose docstrings pydantic parses with `ast`, and CPython 3.11's AST builder
# counts its recursion in one per-interpreter field, so a parse racing one in another thread
# (an earlier test's, in the same worker) fails with "AST constructor recursion depth
# mismatch" (python/cpython#106905; seen once in CI). Collection runs before any test's thread.
from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            out.append(pb.Record.FromString(pending))
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each `run.log` call's values."""
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def summary(path: Path) -> dict[str, Any]:
    """The run summary's last values."""
    out: dict[str, Any] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
