"""Task sources: a JSONL or Parquet dataset, or an environment's own generator.

Tasks are addressed by a cursor (how many were fed so far), so a restored trainer continues
exactly where the durable cursor says, and every epoch is a seeded permutation of the rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    pass


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` / `.parquet` file, each a JSON object (the task payload)."""
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not JSON: {exc}") from exc
    else:
        raise DatasetError(f"dataset {path}: expected .jsonl or .parquet")
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"dataset {path}: needs at least one row, each a JSON object")
    return rows


class TaskSource:
    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def take(self, cursor: int, n: int) -> list[dict[str, Any]]:
        """Tasks cursor .. cursor + n - 1 (wrapping into new epochs)."""
        size = len(self.rows)
        return [self.rows[self._order(i // size)[i % size]] for i in range(cursor, cursor + n)]
