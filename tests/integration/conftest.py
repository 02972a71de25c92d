"""Fixtures the integration tests share (the session's real servers come from
`tests/conftest.py`)."""

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def redis_client(infra):
    """An async client of the session's real Redis."""
    r = aioredis.from_url(infra.redis_url)
    yield r
    await r.aclose()
