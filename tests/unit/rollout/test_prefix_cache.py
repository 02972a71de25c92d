"""The hf engine's prefix cache: longest-prefix lookup by block hashes, LRU by bytes."""

from __future__ import annotations

import pytest
import torch

from treadle_rollout.engines.prefix_cache import BLOCK, Entry, PrefixCache

pytestmark = pytest.mark.unit


def entry(tokens: list[int]) -> Entry:
    kv = torch.arange(len(tokens), dtype=torch.float32).reshape(1, len(tokens), 1)
    return Entry(list(tokens), [kv], [kv.clone()])


def test_longest_prefix_wins_and_the_last_prompt_token_is_left_to_compute():
    cache = PrefixCache(1 << 20)
    short, long_ = list(range(40)), list(range(40)) + [7] * 30
    cache.insert(entry(short))
    cache.insert(entry(long_))
    hit = cache.match(list(range(40)) + [7] * 10 + [9])
    assert hit is not None and hit.entry.tokens == long_ and hit.length == 50
    # the whole prompt is cached: all but its last token are reused
    hit = cache.match(list(range(40)))
    assert hit is not None and hit.length == 39
    assert cache.match(list(range(1, 41))) is None  # shares no first block
    assert cache.match(list(range(BLOCK - 1))) is None  # shorter than a block


def test_match_extends_past_the_last_whole_block():
    cache = PrefixCache(1 << 20)
    cache.insert(entry(list(range(2 * BLOCK + 5))))
    hit = cache.match(list(range(2 * BLOCK + 3)) + [999, 1000])
    assert hit is not None and hit.length == 2 * BLOCK + 3


def test_a_hash_collision_is_a_miss_not_wrong_kv(monkeypatch):
    cache = PrefixCache(1 << 20)
    cache.insert(entry(list(range(BLOCK + 4))))
    monkeypatch.setattr(
        "treadle_rollout.engines.prefix_cache.block_hashes",
        lambda tokens: [h for h in cache._by_hash][: len(tokens) // BLOCK],
    )
    assert cache.match([500 + i for i in range(BLOCK + 4)]) is None


def test_least_recently_used_entries_leave_first_by_bytes():
    one = entry(list(range(32))).nbytes
    cache = PrefixCache(2 * one)
    a, b, c = (entry([base + i for i in range(32)]) for base in (0, 100, 200))
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a.tokens) is not None  # a is now the most recently used
    cache.insert(c)
    assert cache.bytes <= 2 * one and len(cache) == 2
    assert cache.match(b.tokens) is None and cache.match(a.tokens) is not None


def test_an_entry_is_replaced_by_the_one_that_extends_it():
    cache = PrefixCache(1 << 20)
    first = entry(list(range(20)))
    cache.insert(first)
    cache.insert(entry(list(range(20)) + [5] * 20), extends=first)
    assert len(cache) == 1
    diverged = entry(list(range(10)) + [6] * 20)
    cache.insert(diverged, extends=cache.match(list(range(30)) + [1]).entry)
    assert len(cache) == 2  # it does not hold the other's tokens: both stay


def test_disabled_cache_keeps_nothing():
    cache = PrefixCache(0)
    cache.insert(entry(list(range(64))))
    assert len(cache) == 0 and cache.match(list(range(64))) is None
