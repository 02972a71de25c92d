"""Prefix cache for the hf engine: the KV of finished sequences, found again by token prefix.

A multi-turn episode sends its whole transcript every turn, and the samples of a group share
their first prompt. Without a cache every turn pays a prefill of everything before it; with
it, a request prefills only what follows the longest cached prefix (vLLM's automatic prefix
caching, SGLang's radix cache).

Entries are indexed by chained hashes of whole `BLOCK`-token blocks, so a lookup costs one
dict probe per block of the prompt, then a token-by-token extension inside the last block.
A hit is checked against the entry's tokens, so a hash collision costs a miss, never wrong
KV. Entries are evicted least recently used first, by bytes. An entry that a longer one
extends (the next turn of the same episode) is dropped when the longer one arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16


@dataclass(eq=False)
class Entry:
    tokens: list[int]
    keys: list[torch.Tensor]
    """Per layer, [heads, len(tokens), head_dim]."""
    values: list[torch.Tensor]
    hashes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class Hit:
    entry: Entry
    length: int
    """How many leading tokens of the prompt the entry's KV covers."""


def block_hashes(tokens: list[int]) -> list[int]:
    """Chained hash of every whole block: hashes[i] stands for tokens[: (i + 1) * BLOCK]."""
    out: list[int] = []
    h = 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[start : start + BLOCK]))
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._by_hash: dict[int, Entry] = {}
        self.hit_tokens = 0
        self.lookup_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._by_hash.clear()
        self.bytes = 0

    def match(self, prompt: list[int]) -> Hit | None:
        """The entry sharing the longest prefix with `prompt`, leaving at least its last token
        to compute (the next token's logits come from it)."""
        limit = len(prompt) - 1
        self.lookup_tokens += len(prompt)
        if not self._entries:  # empty (or disabled): skip hashing the prompt
            return None
        hashes = block_hashes(prompt[:limit])
        for i in range(len(hashes) - 1, -1, -1):
            entry = self._by_hash.get(hashes[i])
            if entry is None:
                continue
            known = (i + 1) * BLOCK
            if entry.tokens[:known] != prompt[:known]:
                continue  # a hash collision
            length = known
            end = min(limit, len(entry.tokens))
            while length < end and entry.tokens[length] == prompt[length]:
                length += 1
            self._entries.move_to_end(id(entry))
            self.hit_tokens += length
            return Hit(entry, length)
        return None

    def insert(self, entry: Entry, extends: Entry | None = None) -> None:
        """Add `entry`; drop `extends` if `entry` holds all of its tokens."""
        if self.max_bytes <= 0 or len(entry.tokens) < BLOCK or entry.nbytes > self.max_bytes:
            return
        if (
            extends is not None
            and id(extends) in self._entries
            and entry.tokens[: len(extends.tokens)] == extends.tokens
        ):
            self._remove(extends)
        entry.hashes = block_hashes(entry.tokens)
        for h in entry.hashes:
            self._by_hash[h] = entry  # the newest entry answers for a shared prefix
        self._entries[id(entry)] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries.values())))

    def _remove(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            if self._by_hash.get(h) is entry:
                del self._by_hash[h]
