"""Tinker's futures: a request is accepted at once with a `request_id`, runs in order behind
the earlier requests of the same model, and its result is fetched with `retrieve_future`.

Retrieval long-polls: it waits up to `POLL_S` for the result, then answers `try_again` (the
SDK asks again). A failed request answers `{"error", "category"}`: `user` for bad input (the
SDK raises at once), `server` otherwise. A request re-sent with the same (model, seq_id) (the
SDK retries a POST whose answer was lost) gets the first one's request id: nothing runs twice.
Results are kept until fetched and then for `KEEP_S` more (a retried fetch finds them), and
never more than `MAX_KEPT` at once (oldest dropped first). A request id belongs to the tenant
that submitted it: another tenant's `retrieve_future` of it is refused (403).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from treadle_common.auth import policy as auth
from treadle_common.runtime.logs import get_logger
from treadle_trainer.errors import ServiceError

log = get_logger(__name__)

POLL_S = 20.0
KEEP_S = 600.0
MAX_KEPT = 4096


@dataclass
class Result:
    """A finished request: a JSON body, or protobuf bytes (`proto`), or an error."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"


@dataclass
class _Entry:
    task: asyncio.Task[Result]
    fetched_at: float | None = None
    key: tuple[str, str, int] | None = None
    tenant: str = auth.DEFAULT_TENANT


@dataclass
class Futures:
    entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    by_key: dict[tuple[str, str, int], str] = field(default_factory=dict)
    queues: dict[str, asyncio.Lock] = field(default_factory=dict)

    def submit(
        self,
        work: Callable[[], Awaitable[Result]],
        queue: str,
        seq_id: int | None = None,
        ordered: bool = True,
        tenant: str = auth.DEFAULT_TENANT,
    ) -> str:
        """Run `work` after the earlier work of `queue` (a model) or, not `ordered` (a
        sampler's requests), at once; its request id, `tenant`'s."""
        key = (tenant, queue, seq_id) if seq_id is not None else None
        if key is not None and key in self.by_key and self.by_key[key] in self.entries:
            return self.by_key[key]
        lock = self.queues.setdefault(queue, asyncio.Lock()) if ordered else None

        async def run() -> Result:
            async with lock or contextlib.nullcontext():
                try:
                    return await work()
                except ServiceError as exc:  # a refusal (4xx) is the caller's, 5xx the server's
                    category = "user" if exc.http_status < 500 else "server"
                    return Result(error=exc.message, category=category)
                except Exception as exc:  # reported to the caller through its future
                    log.exception("tinker request failed", queue=queue)
                    return Result(error=f"{type(exc).__name__}: {exc}", category="server")

        request_id = uuid.uuid4().hex
        self.entries[request_id] = _Entry(asyncio.create_task(run()), key=key, tenant=tenant)
        if key is not None:
            self.by_key[key] = request_id
        self._expire()
        return request_id

    async def retrieve(self, request_id: str, wait_s: float = POLL_S) -> Result | None:
        """The result, or None while it is still running after `wait_s`; KeyError if unknown,
        `auth.AuthError` (403) if another tenant's."""
        entry = self.entries[request_id]
        auth.refuse_unless_owns(entry.tenant, f"request {request_id}")
        done, _ = await asyncio.wait({entry.task}, timeout=wait_s)
        if not done:
            return None
        entry.fetched_at = entry.fetched_at or time.monotonic()
        return entry.task.result()

    def forget(self, queue: str) -> None:
        self.queues.pop(queue, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id in list(self.entries):
            entry = self.entries[request_id]
            stale = entry.fetched_at is not None and now - entry.fetched_at > KEEP_S
            if stale or (len(self.entries) > MAX_KEPT and entry.task.done()):
                del self.entries[request_id]
                if entry.key is not None:
                    self.by_key.pop(entry.key, None)
