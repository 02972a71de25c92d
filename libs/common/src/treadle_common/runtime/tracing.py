"""OpenTelemetry traces across every hop: one trace per task, from feeding to training.

    trainer feeds a task        -> Task.trace (Redis entry)        -> rollout.task
    rollout.episode             -> gRPC metadata                   -> env.create / env.step
                                -> NATS headers                    -> reward.score
    the trajectory              -> Trajectory.trace (Redis entry)  -> trainer.queued, trainer.step

    and one trace per published version, and one per swap of a replica to a version:
    trainer.publish             -> gRPC metadata                   -> weight-store.publish
    rollout.swap                -> gRPC metadata                   -> weight-store.fetch

Context travels as W3C `traceparent`/`tracestate` (the global propagator), with the
sampling decision: `TREADLE_TRACE_SAMPLE` (default 0.1) of the traces are recorded, decided
where each trace starts (a task's feeding), so a recorded trace is complete. Spans go to OTLP
when `TREADLE_TRACES=otlp` (`TREADLE_OTLP_ENDPOINT`, gRPC), else to a JSON-lines file per
process under `{state_dir}/traces/` (`TREADLE_TRACES=file`, the default), or nowhere (`off`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind

from treadle_common.proto.treadle.v1 import common_pb2

_lock = threading.Lock()
_configured = False


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as the JSON object its line holds: the fields of the SDK's `to_json`
    (ids as 0x-prefixed hex), times as integer Unix nanoseconds, the resource's attributes."""
    context, parent = span.context, span.parent
    status = span.status
    return {
        "name": span.name,
        "context": {
            "trace_id": f"0x{context.trace_id:032x}" if context else None,
            "span_id": f"0x{context.span_id:016x}" if context else None,
        },
        "kind": span.kind.name,
        "parent_id": f"0x{parent.span_id:016x}" if parent is not None else None,
        "start_time_ns": span.start_time,
        "end_time_ns": span.end_time,
        "status": status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "resource": {"attributes": dict(span.resource.attributes)},
    }


class JsonlSpanExporter(SpanExporter):
    """Each finished span as one JSON line (`span_record`). Serialized in one `json.dumps`
    per span: the SDK's `to_json` (indented, with the resource re-encoded per span) cost the
    rollout service several percent of a core at 64 episodes per step."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        dumps = json.JSONEncoder(separators=(",", ":"), default=str).encode
        lines = [dumps(span_record(s)) for s in spans]
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def setup(
    service: str,
    mode: str,
    trace_dir: Path,
    instance: str,
    otlp_endpoint: str,
    sample: float = 1.0,
) -> None:
    """Install the process-wide tracer provider once (later calls do nothing). `sample` is the
    fraction of traces recorded: the service that starts a trace decides (by trace id), every
    later hop follows the decision carried in `traceparent`, so a trace is whole or absent."""
    global _configured
    with _lock:
        if _configured or mode == "off":
            return
        _configured = True
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample)))
    exporter: SpanExporter
    if mode == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
    else:
        exporter = JsonlSpanExporter(trace_dir / f"{service}-{instance}.jsonl")
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    trace.set_tracer_provider(provider)


def flush() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()


_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """The process's tracer (created once: `get_tracer` builds a new one per call; before
    `setup` it is the API's proxy, which follows the provider `setup` installs)."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer("treadle")
    return _tracer


# --- carriers ----------------------------------------------------------------------------------
def _carrier() -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def inject_proto(message: common_pb2.TraceContext) -> None:
    """Write the current span's context into a proto `TraceContext` (Redis entries)."""
    carrier = _carrier()
    message.traceparent = carrier.get("traceparent", "")
    message.tracestate = carrier.get("tracestate", "")


def recorded(traceparent: str) -> bool:
    """Whether a W3C `traceparent` (version-traceid-spanid-flags) carries the sampled flag."""
    return len(traceparent) == 55 and int(traceparent[53:], 16) & 1 == 1


def item_span(
    name: str, message: common_pb2.TraceContext, kind: SpanKind = SpanKind.SERVER
) -> AbstractContextManager[trace.Span]:
    """The span of one item of a batched call (a score, an env step), in the item's own trace;
    for an item whose trace is not recorded, nothing (no context extracted, no span made: at
    64 items per batch that work was a good part of a batch's cost)."""
    if not recorded(message.traceparent):
        return nullcontext(trace.INVALID_SPAN)
    return tracer().start_as_current_span(name, context=from_proto(message), kind=kind)


def from_proto(message: common_pb2.TraceContext) -> Context | None:
    if not message.traceparent:
        return None
    return propagate.extract({"traceparent": message.traceparent, "tracestate": message.tracestate})


def current_trace_id() -> int:
    """The current span's trace id (0 outside any trace)."""
    return trace.get_current_span().get_span_context().trace_id


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current context as gRPC call metadata."""
    return tuple(_carrier().items())


def from_grpc(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    return propagate.extract({k: v for k, v in metadata or () if isinstance(v, str)})


def call_span(name: str, metadata: Iterable[tuple[str, Any]] | None) -> trace.Span:
    """A server's span of a call whose caller's trace is recorded (its gRPC metadata carries
    the context), started, not made current (a streaming handler ends it when the stream
    ends); for any other call, the invalid span, which records nothing: a call outside a
    trace starts none."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    if not recorded(carrier.get("traceparent", "")):
        return trace.INVALID_SPAN
    context = propagate.extract(carrier)
    return tracer().start_span(name, context=context, kind=SpanKind.SERVER)


def nats_headers() -> dict[str, str]:
    """The current context as NATS message headers."""
    return _carrier()


def from_headers(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def ns(unix_seconds: float) -> int:
    return int(unix_seconds * 1e9)
