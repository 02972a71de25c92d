"""Preallocated KV cache of the hf engine's running batch.

transformers' `DynamicCache` appends each decode step's keys and values with `torch.cat`,
copying the whole cache every step; on a CPU that copy costs as much as the attention that
reads it. `KVSlab` keeps keys, values and the attention mask in buffers of `rows x columns`
that grow by doubling:

- a decode step writes one column in place (`Cache` layers that write into the slab);
- every row's tokens end at column `end`; the batch's view is columns `[start, end)`, where
  `start` is the first column any row uses, so columns left of a short row are padding
  (masked: the attention never sees them);
- a joining row is copied in at `rows`; a leaving row is replaced by the last row (one row
  copied, not the batch);
- when the view reaches the last column, the live part moves back to the left edge of the
  same buffers, a copy of the live part once every so many steps. New buffers are
  allocated only to grow (rows, or columns when the live part needs more than half of
  them): fresh buffers cost their page faults again (measured on the 2-core dev machine,
  the bench's model at 64 rows x 256-512 columns: 60-90 ms, against 3-5 ms to move the
  live part), and requests joining one or two at a time reach the last column often.

Columns outside the live part keep stale keys and values of rows that left (finite, and
masked: the attention gives them no weight); the mask is zero there.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _SlabLayer(DynamicLayer):
    """One layer of the slab as transformers sees it: `update` writes the new columns in
    place and returns views of the batch's columns."""

    def __init__(self, slab: KVSlab, index: int):
        super().__init__()
        self.slab, self.index = slab, index
        self.is_initialized = True
        self._view(0)

    def _view(self, extra: int) -> None:
        s = self.slab
        stop = s.end + extra
        self.keys = s.keys[self.index][: s.rows, :, s.start : stop]
        self.values = s.values[self.index][: s.rows, :, s.start : stop]
        self.dtype, self.device = self.keys.dtype, self.keys.device

    def update(self, key_states, value_states, *args, **kwargs):
        s, q = self.slab, key_states.shape[2]
        s.keys[self.index][: s.rows, :, s.end : s.end + q] = key_states
        s.values[self.index][: s.rows, :, s.end : s.end + q] = value_states
        self._view(q)
        return self.keys, self.values


class KVSlab:
    def __init__(self, layers: int, heads: int, head_dim: int, dtype, device, max_rows: int):
        self.shape = (layers, heads, head_dim)
        self.dtype, self.device, self.max_rows = dtype, device, max_rows
        self.rows = self.start = self.end = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.allocations = 0
        """How many times the buffers were allocated (growth), the first time included."""
        self._allocate(min(8, max_rows), 64, keep=0)

    # -- capacity --------------------------------------------------------------------------
    @property
    def capacity(self) -> tuple[int, int]:
        return self.mask.shape[0], self.mask.shape[1]

    def _allocate(self, rows: int, columns: int, keep: int) -> None:
        """New buffers; the live columns move so that they end at column `keep`."""
        layers, heads, dim = self.shape
        span = self.end - self.start
        keys = [
            torch.zeros(rows, heads, columns, dim, dtype=self.dtype, device=self.device)
            for _ in range(layers)
        ]
        values = [torch.zeros_like(k) for k in keys]
        mask = torch.zeros(rows, columns, dtype=torch.long, device=self.device)
        if self.rows:
            for new, old in zip([*keys, *values], [*self.keys, *self.values], strict=True):
                new[: self.rows, :, keep - span : keep] = old[: self.rows, :, self.start : self.end]
            mask[: self.rows, keep - span : keep] = self.mask[: self.rows, self.start : self.end]
        self.keys, self.values, self.mask = keys, values, mask
        self.start, self.end = keep - span, keep
        self.allocations += 1

    def _move(self, keep: int) -> None:
        """Move the live columns, in the same buffers, so that they end at column `keep`."""
        span = self.end - self.start
        if keep - span == self.start:
            return
        live = slice(self.start, self.end)
        overlap = keep > self.start  # then the live part is copied out first
        for buffer in (*self.keys, *self.values):
            part = buffer[: self.rows, :, live]
            buffer[: self.rows, :, keep - span : keep] = part.clone() if overlap else part
        mask = self.mask[: self.rows, live].clone()
        self.mask.zero_()
        self.mask[: self.rows, keep - span : keep] = mask
        self.start, self.end = keep - span, keep

    def _fit(self, rows: int, left: int, right: int) -> None:
        """Room for `rows` rows, `left` columns before `end` and `right` columns after it."""
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the slab's {self.max_rows}")
        have_rows, have_columns = self.capacity
        span = self.end - self.start
        left = max(left, span)
        if rows <= have_rows and left <= self.end and self.end + right <= have_columns:
            return
        if rows <= have_rows and 2 * (left + right) <= have_columns:
            self._move(keep=left)
            return
        new_rows = have_rows
        while new_rows < rows:
            new_rows = min(self.max_rows, 2 * new_rows)
        new_columns = have_columns
        while new_columns < 2 * (left + right):
            new_columns *= 2
        self._allocate(new_rows, new_columns, keep=left)

    # -- rows ------------------------------------------------------------------------------
    def add(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> None:
        """Append rows whose cache is right-aligned (`[n, heads, length, dim]`, `[n, length]`)."""
        n, length = mask.shape
        if self.rows == 0:  # an empty batch: end where the longest new row fits, if it does
            self.start = self.end = min(length, self.capacity[1] - 1)
        self._fit(self.rows + n, length, 1)
        rows = slice(self.rows, self.rows + n)
        for slab, new in zip([*self.keys, *self.values], [*keys, *values], strict=True):
            slab[rows, :, self.end - length : self.end] = new
        self.mask[rows] = 0
        self.mask[rows, self.end - length : self.end] = mask
        self.rows += n
        self.start = min(self.start, self.end - length)
        self._trim()

    def remove(self, rows: list[int]) -> None:
        """Drop `rows`: each is overwritten by the current last row (callers reorder alike)."""
        for row in sorted(rows, reverse=True):
            last = self.rows - 1
            if row != last:
                for slab in (*self.keys, *self.values):
                    slab[row, :, self.start : self.end] = slab[last, :, self.start : self.end]
                self.mask[row] = self.mask[last]
            self.rows -= 1
        self._trim()

    def _trim(self) -> None:
        """Start the view at the first column a row uses."""
        if self.rows == 0:
            self.start = self.end
            return
        used = self.mask[: self.rows, self.start : self.end].any(0).nonzero()
        if len(used):
            self.start += int(used[0])

    def clear(self) -> None:
        self.rows = 0
        self.start = self.end

    # -- a decode step ---------------------------------------------------------------------
    def begin_step(self) -> tuple[Cache, torch.Tensor, torch.Tensor]:
        """Open one new column: the cache to pass to the model, the attention mask
        (`[rows, span + 1]`) and each row's position for the new token (`[rows, 1]`)."""
        self._fit(self.rows, 0, 1)
        positions_B_1 = self.mask[: self.rows, self.start : self.end].sum(1, keepdim=True)
        self.mask[: self.rows, self.end] = 1
        mask_B_T = self.mask[: self.rows, self.start : self.end + 1]
        cache = Cache(layers=[_SlabLayer(self, i) for i in range(self.shape[0])])
        return cache, mask_B_T, positions_B_1

    def end_step(self) -> None:
        self.end += 1

    def row_kv(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One row's cached tokens, in order: per layer `[heads, tokens, dim]` copies."""
        used_T = self.mask[row, self.start : self.end].bool()
        keys = [k[row, :, self.start : self.end][:, used_T] for k in self.keys]
        values = [v[row, :, self.start : self.end][:, used_T] for v in self.values]
        return keys, values
