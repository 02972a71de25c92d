"""A bound on the generation requests clients bring (the OpenAI API, gRPC `Generate`).

Episodes the replica plays for a run are bounded by its task concurrency; requests from
outside are not, so each one passes this gate: past `limit` in flight, a request is refused
at once (HTTP 429, gRPC RESOURCE_EXHAUSTED) and counted, instead of joining an engine queue
that would grow without end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from treadle_common.runtime import metrics


class Busy(Exception):
    """The engine already holds as many client requests as the gate admits."""


class RequestGate:
    def __init__(self, limit: int, service: str = "rollout"):
        self.limit, self.service = limit, service
        self.in_flight = 0
        self.refused = 0

    def check(self, requests: int = 1) -> None:
        """Refuse (Busy, counted) if `requests` more would pass the limit."""
        if self.in_flight + requests > self.limit:
            self.refused += 1
            metrics.DROPPED.labels(self.service, "generate", "busy").inc()
            raise Busy(
                f"{self.in_flight} client generation requests are in flight, the most this "
                f"replica queues (TREADLE_ROLLOUT_MAX_QUEUED={self.limit}); retry later"
            )

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        self.check()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
