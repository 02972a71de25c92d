"""Prometheus helpers shared by every service.

Each service process owns the default registry; `/metrics` serves it. Drops are counted in
one counter with a `reason` label so nothing disappears silently.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

DROPPED = Counter(
    "treadle_dropped_total",
    "Items dropped, by service, kind and reason",
    ["service", "kind", "reason"],
)
REQUESTS = Counter(
    "treadle_requests_total",
    "Requests handled, by service, method and outcome",
    ["service", "method", "outcome"],
)
LATENCY = Histogram(
    "treadle_request_seconds", "Request latency, by service and method", ["service", "method"]
)
READY = Gauge("treadle_ready", "1 when the service is ready", ["service"])


def render() -> tuple[bytes, str]:
    """Body and content type for a `/metrics` response."""
    return generate_latest(), CONTENT_TYPE_LATEST
