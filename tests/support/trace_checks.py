"""Reading back what `treadle trace` wrote, with each format's own schema: Perfetto's trace
messages (the `perfetto` package) and OTLP's `TracesData` (opentelemetry-proto); and, where a
Perfetto trace processor binary is at hand (`TREADLE_TRACE_PROCESSOR`), Perfetto's own trace
processor."""

from __future__ import annotations

import base64
import json
import os
from collections import defaultdict
from pathlib import Path

FIVE = {"trainer", "rollout", "env-gateway", "reward", "weight-store"}


def perfetto_slices(path: Path) -> tuple[dict[int, str], list[dict]]:
    """(track uuid -> its process's name, every slice with its track, name and args), after
    checking that each track's begins and ends nest."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    trace = Trace.FromString(path.read_bytes())
    process_of: dict[int, str] = {}
    names: dict[int, str] = {}
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("process"):
                names[d.uuid] = d.process.process_name
            else:
                process_of[d.uuid] = names[d.parent_uuid]
    open_: dict[int, list[dict]] = defaultdict(list)
    slices, last_ts = [], 0
    for packet in trace.packet:
        if not packet.HasField("track_event"):
            continue
        assert packet.timestamp >= last_ts, "packets out of time order"
        last_ts = packet.timestamp
        event = packet.track_event
        if event.type == TrackEvent.TYPE_SLICE_BEGIN:
            args = {}
            for a in event.debug_annotations:
                args[a.name] = getattr(a, a.WhichOneof("value"))
            item = {"track": event.track_uuid, "name": event.name, "args": args}
            item["start"] = packet.timestamp
            open_[event.track_uuid].append(item)
            slices.append(item)
        else:
            assert open_[event.track_uuid], f"an end with no open slice on {event.track_uuid}"
            open_[event.track_uuid].pop()["end"] = packet.timestamp
    assert not any(open_.values()), "slices left open"
    return process_of, slices


def check_perfetto(path: Path) -> dict[str, int]:
    """One task's slices on the trainer's, rollout's, env-gateway's and reward's lanes, and
    the weight-store's publish and fetch of the version it generated with: the services
    seen for that task, by name, with their slice counts."""
    process_of, slices = perfetto_slices(path)
    assert FIVE | {"steps"} <= set(process_of.values()), set(process_of.values())
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in slices:
        by_trace[str(s["args"].get("trace_id"))].append(s)
    for trace in by_trace.values():
        services = {process_of[s["track"]] for s in trace}
        versions = {
            int(s["args"]["treadle.version"]) for s in trace if s["name"] == "rollout.generate"
        }
        if not {"trainer", "rollout", "env-gateway", "reward"} <= services or not versions:
            continue
        version = max(versions)
        weights = [
            s
            for s in slices
            if process_of[s["track"]] == "weight-store"
            and int(s["args"].get("treadle.version", -2)) == version
        ]
        if {s["name"] for s in weights} == {"weight-store.publish", "weight-store.fetch"}:
            seen = [process_of[s["track"]] for s in trace + weights]
            return {service: seen.count(service) for service in set(seen)}
    raise AssertionError("no task whose slices reach all five services")


def check_otlp_json(path: Path) -> int:
    """The file parses as OTLP's `TracesData` (ids hex as OTLP/JSON writes them, which
    protobuf's JSON mapping reads as base64); its span count."""
    from google.protobuf import json_format
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    data = json.loads(path.read_text())
    for resource in data["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key, size in (("traceId", 16), ("spanId", 8), ("parentSpanId", 8)):
                    if key in span:
                        raw = bytes.fromhex(span[key])
                        assert len(raw) == size, (key, span[key])
                        span[key] = base64.b64encode(raw).decode()
    parsed = json_format.ParseDict(data, TracesData())
    return sum(len(s.spans) for r in parsed.resource_spans for s in r.scope_spans)


def trace_processor_slices(path: Path) -> int | None:
    """The slices Perfetto's trace processor finds in the file, or None when no trace
    processor binary is at hand (`TREADLE_TRACE_PROCESSOR`: the Python package downloads
    one from Google's storage, which this machine cannot reach)."""
    binary = os.environ.get("TREADLE_TRACE_PROCESSOR")
    if not binary:
        return None
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    with TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=binary)) as tp:
        return int(next(iter(tp.query("select count(*) as n from slice"))).n)
