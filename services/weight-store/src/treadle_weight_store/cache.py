"""Hot-chunk cache: many replicas fetching the same new version cost one backend read.

A byte-bounded LRU of verified chunk bytes plus single-flight loading: concurrent misses of
the same chunk share one backend read.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

CACHE = Counter("treadle_weight_cache_total", "Chunk cache lookups", ["result"])


class ChunkCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._loading: dict[str, asyncio.Future[bytes]] = {}

    def put(self, digest: str, data: bytes) -> None:
        if len(data) > self.max_bytes or digest in self._items:
            return
        self._items[digest] = data
        self.num_bytes += len(data)
        while self.num_bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.num_bytes -= len(evicted)

    def __contains__(self, digest: str) -> bool:
        return digest in self._items

    def discard(self, digest: str) -> None:
        data = self._items.pop(digest, None)
        if data is not None:
            self.num_bytes -= len(data)

    async def get(self, digest: str, load: Callable[[], Awaitable[bytes]]) -> bytes:
        data = self._items.get(digest)
        if data is not None:
            self._items.move_to_end(digest)
            CACHE.labels("hit").inc()
            return data
        pending = self._loading.get(digest)
        if pending is not None:
            CACHE.labels("shared").inc()
            return await asyncio.shield(pending)
        CACHE.labels("miss").inc()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._loading[digest] = future
        try:
            data = await load()
            self.put(digest, data)
            future.set_result(data)
            return data
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters get it, nobody else must
            raise
        finally:
            del self._loading[digest]
