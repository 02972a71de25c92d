"""Tenant quotas on the OpenAI API's generations (`treadle_common.fleet.quotas`): each generation
(one choice of a request) is one of its tenant's episodes while it runs, and its tokens count
toward the tenant's minute. Past a quota the request gets 429 naming it.

The tenant is the caller's (`REQUEST_TENANT`, set by the HTTP routes). A played episode's
turns (env-gateway `Play`) set none: their task already holds its episodes in the worker.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from contextvars import ContextVar

from treadle_common.fleet.quotas import QuotaExceeded, TenantQuotas
from treadle_rollout.errors import OpenAIError

REQUEST_TENANT: ContextVar[str | None] = ContextVar("treadle_request_tenant", default=None)


class QuotaGate:
    def __init__(self, quotas: TenantQuotas | None = None):
        self.quotas = quotas

    @contextlib.asynccontextmanager
    async def generation(self) -> AsyncIterator[list[int]]:
        """Around one generation: yields a one-item counter of the tokens it generated."""
        counted = [0]
        tenant, quotas = REQUEST_TENANT.get(), self.quotas
        if quotas is None or tenant is None:
            yield counted
            return
        lease = [uuid.uuid4().hex] if quotas.max_episodes else []
        try:
            await quotas.check_tokens(tenant)
            if lease:
                await quotas.take_episodes(tenant, lease)
        except QuotaExceeded as exc:
            raise OpenAIError(429, str(exc), code="quota_exceeded") from exc
        try:
            yield counted
        finally:
            await quotas.release_episodes(tenant, lease)
            await quotas.add_tokens(tenant, counted[0])
