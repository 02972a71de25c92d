"""`treadle trace RUN_ID`: a run's spans as one file that Perfetto or Jaeger opens.

Every process writes its finished spans as JSON lines under `{state_dir}/traces/`
(`treadle_common.runtime.tracing`, `TREADLE_TRACES=file`). The run's spans are:

- each trace whose root `trainer.feed_task` names the run (`treadle.run_id`): one task,
  across the trainer, rollout, env-gateway and reward;
- each `trainer.publish` trace that names it: a version published, with the weight-store's
  `weight-store.publish`;
- each `rollout.swap` trace of a model the run published: a replica fetching a version,
  with the weight-store's `weight-store.fetch`.

Formats:

- `perfetto`: Perfetto's protobuf trace (`TrackEvent`s), written with Perfetto's own message
  classes (the `perfetto` package). A process per service, its spans on lanes (threads) so
  that the slices on each lane nest; a `steps` process with a lane of training steps and a
  lane of published versions. Every slice carries its span's attributes, trace and span id,
  and the step that trained its trace (`treadle.step`).
- `otlp-json`: OpenTelemetry's OTLP/JSON encoding of `TracesData` (ids in hex, times in
  nanoseconds as strings): a `resourceSpans` per process. Jaeger's UI opens it (Upload),
  and so does any OTLP tool.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPAN_KINDS = {"INTERNAL": 1, "SERVER": 2, "CLIENT": 3, "PRODUCER": 4, "CONSUMER": 5}
STATUS_CODES = {"UNSET": 0, "OK": 1, "ERROR": 2}
FORMATS = ("perfetto", "otlp-json")


@dataclass
class Span:
    name: str
    trace_id: str
    """32 hex digits."""
    span_id: str
    """16 hex digits."""
    parent_id: str | None
    start_ns: int
    end_ns: int
    kind: str
    status: str
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    resource: dict[str, Any]

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", "unknown"))

    @classmethod
    def of(cls, record: dict[str, Any]) -> Span:
        """A span from its JSON line (`tracing.span_record`)."""
        context, parent = record["context"], record.get("parent_id")
        return cls(
            name=record["name"],
            trace_id=context["trace_id"].removeprefix("0x"),
            span_id=context["span_id"].removeprefix("0x"),
            parent_id=parent.removeprefix("0x") if parent else None,
            start_ns=int(record["start_time_ns"]),
            end_ns=int(record["end_time_ns"]),
            kind=record.get("kind", "INTERNAL"),
            status=record.get("status", "UNSET"),
            attributes=record.get("attributes") or {},
            events=record.get("events") or [],
            resource=(record.get("resource") or {}).get("attributes") or {},
        )


@dataclass
class RunSpans:
    run_id: str
    spans: list[Span]
    unreadable_lines: int = 0
    step_of_trace: dict[str, int] = field(default_factory=dict)
    """Trace id -> the step that trained it (a task's trace that reached training)."""


def read_spans(trace_dir: Path) -> tuple[list[Span], int]:
    """Every span in the directory's `*.jsonl` files, and the number of lines that were not
    spans (a file cut short by a killed process ends in a partial line)."""
    spans, bad = [], 0
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(Span.of(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                bad += 1
    return spans, bad


def run_spans(trace_dir: Path, run_id: str) -> RunSpans:
    """The run's spans (the module docstring says which), oldest first."""
    spans, bad = read_spans(trace_dir)
    by_trace: dict[str, list[Span]] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id, []).append(span)

    def names_run(span: Span, name: str) -> bool:
        return span.name == name and span.attributes.get("treadle.run_id") == run_id

    tasks = {s.trace_id for s in spans if names_run(s, "trainer.feed_task")}
    publishes = [s for s in spans if names_run(s, "trainer.publish")]
    models = {s.attributes.get("treadle.model") for s in publishes}
    swaps = {
        s.trace_id
        for s in spans
        if s.name == "rollout.swap" and s.attributes.get("treadle.model") in models
    }
    chosen = tasks | {s.trace_id for s in publishes} | swaps
    selected = sorted(
        (s for t in chosen for s in by_trace[t]), key=lambda s: (s.start_ns, -s.end_ns)
    )
    steps = {
        s.trace_id: int(s.attributes["treadle.step"])
        for s in selected
        if s.name == "trainer.step" and "treadle.step" in s.attributes
    }
    return RunSpans(run_id, selected, bad, steps)


# --- OTLP/JSON ------------------------------------------------------------------------------
def otlp_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [otlp_value(v) for v in value]}}
    return {"stringValue": str(value)}


def otlp_attributes(attributes: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": otlp_value(v)} for k, v in attributes.items()]


def otlp_span(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": span.trace_id,
        "spanId": span.span_id,
        "name": span.name,
        "kind": SPAN_KINDS.get(span.kind, 1),
        "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(span.end_ns),
        "attributes": otlp_attributes(span.attributes),
        "events": [
            {
                "timeUnixNano": str(e.get("time_ns", span.start_ns)),
                "name": e.get("name", ""),
                "attributes": otlp_attributes(e.get("attributes") or {}),
            }
            for e in span.events
        ],
        "status": {"code": STATUS_CODES.get(span.status, 0)},
    }
    if span.parent_id:
        out["parentSpanId"] = span.parent_id
    return out


def to_otlp_json(run: RunSpans) -> dict[str, Any]:
    """`TracesData` in OTLP/JSON: a `resourceSpans` per process (service and instance)."""
    by_process: dict[tuple, list[Span]] = {}
    for span in run.spans:
        by_process.setdefault(tuple(sorted(span.resource.items())), []).append(span)
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": otlp_attributes(dict(resource))},
                "scopeSpans": [
                    {"scope": {"name": "treadle"}, "spans": [otlp_span(s) for s in spans]}
                ],
            }
            for resource, spans in by_process.items()
        ]
    }


# --- Perfetto -------------------------------------------------------------------------------
def lanes(spans: Iterable[Span]) -> list[list[Span]]:
    """The spans on lanes where a slice lies only within its own ancestors' (its parent's,
    their parent's...), so that what Perfetto draws nested is nested in the trace: spans that
    run at once without one containing the other (a group's episodes, the trajectories one
    step trained) get lanes of their own. Spans in start order, longest first at equal
    starts."""
    ordered = sorted(spans, key=lambda s: (s.start_ns, -s.end_ns))
    parent = {s.span_id: s.parent_id for s in ordered}

    def ancestors(span: Span) -> set[str]:
        found, at = set(), span.parent_id
        while at is not None and at not in found:
            found.add(at)
            at = parent.get(at)
        return found

    result: list[list[Span]] = []
    open_: list[list[Span]] = []  # per lane: its slices open at the current time
    for span in ordered:
        mine = ancestors(span)
        for lane, stack in zip(result, open_, strict=True):
            while stack and stack[-1].end_ns <= span.start_ns:
                stack.pop()
            if not stack or (stack[-1].span_id in mine and span.end_ns <= stack[-1].end_ns):
                lane.append(span)
                stack.append(span)
                break
        else:
            result.append([span])
            open_.append([span])
    return result


def lane_events(lane: list[Span]) -> list[tuple[int, str, Span | None]]:
    """A lane's begins and ends in order: ("B", span) and ("E", None) at their times; every
    end comes before a begin at the same time, and a slice's end after its children's."""
    events: list[tuple[int, str, Span | None]] = []
    stack: list[int] = []
    for span in lane:
        while stack and stack[-1] <= span.start_ns:
            events.append((stack.pop(), "E", None))
        events.append((span.start_ns, "B", span))
        stack.append(max(span.end_ns, span.start_ns))
    while stack:
        events.append((stack.pop(), "E", None))
    return events


def step_slices(run: RunSpans) -> tuple[list[Span], list[Span]]:
    """One slice per training step (the span of its trajectories' `trainer.step`; a step
    is no one trace's) and one per published version (its `trainer.publish`)."""
    steps: dict[int, Span] = {}
    publishes = []
    for span in run.spans:
        if span.name == "trainer.step" and "treadle.step" in span.attributes:
            step = int(span.attributes["treadle.step"])
            steps.setdefault(step, span)
        elif span.name == "trainer.publish":
            publishes.append(span)
    trained = [
        Span(f"step {k}", "", "", None, s.start_ns, s.end_ns, "INTERNAL",
             "UNSET", {"treadle.step": k}, [], {"service.name": "steps"})
        for k, s in sorted(steps.items())
    ]  # fmt: skip
    published = [
        Span(f"publish v{s.attributes.get('treadle.version')}", s.trace_id, s.span_id, None,
             s.start_ns, s.end_ns, "INTERNAL", "UNSET", s.attributes, [],
             {"service.name": "steps"})
        for s in publishes
    ]  # fmt: skip
    return trained, published


def perfetto_lanes(run: RunSpans) -> list[tuple[str, list[tuple[str, list[Span]]]]]:
    """(process name, its lanes as (lane name, slices)): a process per service, then
    `steps`."""
    by_service: dict[str, list[Span]] = {}
    for span in run.spans:
        by_service.setdefault(span.service, []).append(span)
    processes = [
        (service, [(f"{service} {i}", lane) for i, lane in enumerate(lanes(spans), start=1)])
        for service, spans in sorted(by_service.items())
    ]
    trained, published = step_slices(run)
    steps = [("training steps", lane) for lane in lanes(trained)]
    steps += [("published versions", lane) for lane in lanes(published)]
    return [*processes, ("steps", steps)]


def to_perfetto(run: RunSpans) -> bytes:
    """The run as a Perfetto protobuf trace (see the module docstring)."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    builder = TraceProtoBuilder()
    streams = []
    for pid, (process_name, process_lanes) in enumerate(perfetto_lanes(run), start=1):
        process = builder.add_packet().track_descriptor
        process.uuid = pid << 20
        process.process.pid, process.process.process_name = pid, process_name
        for tid, (lane_name, lane) in enumerate(process_lanes, start=1):
            thread = builder.add_packet().track_descriptor
            thread.uuid, thread.parent_uuid = process.uuid + tid, process.uuid
            thread.thread.pid, thread.thread.tid = pid, process.uuid + tid
            thread.thread.thread_name = lane_name
            events = lane_events(lane)
            streams.append([(t, i, thread.uuid, span) for i, (t, _, span) in enumerate(events)])
    # one sequence, every lane's events merged in time order (each lane's own order kept)
    for n, (ts, _, uuid, span) in enumerate(heapq.merge(*streams, key=lambda e: e[:2])):
        packet = builder.add_packet()
        packet.timestamp, packet.trusted_packet_sequence_id = ts, 1
        if n == 0:
            packet.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        event = packet.track_event
        event.track_uuid = uuid
        if span is None:
            event.type = TrackEvent.TYPE_SLICE_END
            continue
        event.type, event.name = TrackEvent.TYPE_SLICE_BEGIN, span.name
        for key, value in slice_args(run, span).items():
            annotate(event.debug_annotations.add(), key, value)
    return builder.serialize()


def slice_args(run: RunSpans, span: Span) -> dict[str, Any]:
    """What a slice shows: the span's attributes, its ids, the step that trained its trace."""
    step = run.step_of_trace.get(span.trace_id)
    ids = {"trace_id": span.trace_id, "span_id": span.span_id} if span.trace_id else {}
    args = {**span.attributes, **ids}
    return {**args, "treadle.step": step} if step is not None else args


def annotate(annotation: Any, key: str, value: Any) -> None:
    annotation.name = key
    if isinstance(value, bool):
        annotation.bool_value = value
    elif isinstance(value, int):
        annotation.int_value = value
    elif isinstance(value, float):
        annotation.double_value = value
    else:
        annotation.string_value = str(value)


def export(trace_dir: Path, run_id: str, fmt: str, out: Path) -> RunSpans:
    """Write the run's spans to `out` in `fmt`; the spans written."""
    run = run_spans(trace_dir, run_id)
    if not run.spans:
        raise LookupError(f"no spans of run {run_id!r} under {trace_dir}")
    if fmt == "perfetto":
        out.write_bytes(to_perfetto(run))
    elif fmt == "otlp-json":
        out.write_text(json.dumps(to_otlp_json(run)))
    else:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    return run
