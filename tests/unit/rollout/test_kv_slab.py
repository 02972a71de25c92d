"""The hf engine's preallocated KV slab: rows join, leave and decode without losing a column."""

from __future__ import annotations

import random

import pytest
import torch

from treadle_rollout.engines.kv_slab import KVSlab

pytestmark = pytest.mark.unit


def kv_of(seq_id: int, positions: range) -> torch.Tensor:
    """A recognizable key per (sequence, position): seq_id * 1000 + position."""
    return torch.tensor([seq_id * 1000.0 + p for p in positions]).reshape(1, -1, 1)


def test_rows_join_leave_and_decode_keeping_every_token_in_order():
    rng = random.Random(0)
    slab = KVSlab(layers=2, heads=1, head_dim=1, dtype=torch.float32, device="cpu", max_rows=16)
    rows: list[tuple[int, int]] = []  # (sequence id, tokens cached) per slab row
    next_id = 1
    for _ in range(300):
        action = rng.random()
        if action < 0.15 and len(rows) < 12:  # a few sequences join, right-aligned
            lengths = [rng.randint(1, 90) for _ in range(rng.randint(1, 3))]
            width = max(lengths)
            keys = torch.zeros(len(lengths), 1, width, 1)
            mask = torch.zeros(len(lengths), width, dtype=torch.long)
            for i, n in enumerate(lengths):
                keys[i, :, width - n :] = kv_of(next_id + i, range(n))
                mask[i, width - n :] = 1
            slab.add([keys, keys + 0.5], [keys, keys + 0.5], mask)
            rows += [(next_id + i, n) for i, n in enumerate(lengths)]
            next_id += len(lengths)
        elif action < 0.3 and rows:  # some leave; the last rows fill their places
            gone = rng.sample(range(len(rows)), rng.randint(1, len(rows)))
            slab.remove(gone)
            for row in sorted(gone, reverse=True):
                last = rows.pop()
                if row < len(rows):
                    rows[row] = last
        elif rows:  # one decode step: every row gets its next position
            cache, mask_B_T, positions_B_1 = slab.begin_step()
            assert positions_B_1[:, 0].tolist() == [n for _, n in rows]
            assert mask_B_T.shape == (len(rows), slab.end - slab.start + 1)
            new = torch.stack([kv_of(i, range(n, n + 1)) for i, n in rows])
            for layer in range(2):
                keys, _ = cache.update(new + 0.5 * layer, new + 0.5 * layer, layer)
                assert keys.shape[2] == mask_B_T.shape[1]
            slab.end_step()
            rows = [(i, n + 1) for i, n in rows]
        for row, (seq_id, n) in enumerate(rows):
            keys, values = slab.row_kv(row)
            assert torch.equal(keys[0], kv_of(seq_id, range(n)))
            assert torch.equal(values[1], kv_of(seq_id, range(n)) + 0.5)
        if rows:  # the view starts at the first column some row uses
            assert slab.mask[: slab.rows, slab.start].any()
    assert slab.capacity[1] > 64  # the columns grew and moved along the way


def test_a_steady_batch_moves_back_to_the_left_edge_without_new_buffers():
    """Sequences of a bounded length come and go for many steps: once the buffers are large
    enough the view moves back within them, again and again, and nothing is allocated."""
    slab = KVSlab(layers=1, heads=1, head_dim=1, dtype=torch.float32, device="cpu", max_rows=8)
    rows: list[tuple[int, int]] = []  # (sequence id, tokens cached) per slab row
    next_id, moves, allocations = 1, 0, -1
    for step in range(600):
        if step % 5 == 0:
            oldest = min(range(len(rows)), key=lambda r: rows[r][0], default=None)
            if oldest is not None and rows[oldest][1] >= 40:  # it leaves; the last row moves in
                slab.remove([oldest])
                last = rows.pop()
                if oldest < len(rows):
                    rows[oldest] = last
            if len(rows) < 8:  # a new one joins with 20 tokens
                keys = kv_of(next_id, range(20))
                slab.add([keys], [keys], torch.ones(1, 20, dtype=torch.long))
                rows.append((next_id, 20))
                next_id += 1
        end = slab.end
        cache, _, positions_B_1 = slab.begin_step()
        moves += slab.end < end
        assert positions_B_1[:, 0].tolist() == [n for _, n in rows]
        new = torch.stack([kv_of(i, range(n, n + 1)) for i, n in rows])
        cache.update(new, new, 0)
        slab.end_step()
        rows = [(i, n + 1) for i, n in rows]
        if step == 200:
            allocations = slab.allocations
    assert slab.allocations == allocations  # none after the first 200 steps
    assert moves >= 3  # the view reached the last column and moved back, several times
    for row, (seq_id, n) in enumerate(rows):
        keys, values = slab.row_kv(row)
        assert torch.equal(keys[0], kv_of(seq_id, range(n)))
        assert torch.equal(values[0], kv_of(seq_id, range(n)))
