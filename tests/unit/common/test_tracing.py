"""Tracing helpers: span lines, the sampled flag, batched items of unrecorded traces."""

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from treadle_common.proto.treadle.v1 import common_pb2
from treadle_common.runtime import tracing

pytestmark = pytest.mark.unit


def test_traceparent_sampled_flag():
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert tracing.recorded(f"00-{trace_id}-{span_id}-01")
    assert not tracing.recorded(f"00-{trace_id}-{span_id}-00")
    assert not tracing.recorded("")


def test_an_item_of_an_unrecorded_trace_makes_no_span():
    unsampled = common_pb2.TraceContext(
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    )
    with tracing.item_span("reward.score", unsampled) as span:
        assert span is trace.INVALID_SPAN
    with tracing.item_span("reward.score", common_pb2.TraceContext()) as span:
        assert span is trace.INVALID_SPAN


def test_a_span_line_holds_ids_times_and_service():
    provider = TracerProvider(resource=Resource.create({"service.name": "reward"}))
    parent = provider.get_tracer("t").start_span("parent")
    child = provider.get_tracer("t").start_span("child", context=trace.set_span_in_context(parent))
    child.set_attribute("treadle.step", 3)
    child.end()
    record = json.loads(json.dumps(tracing.span_record(child)))
    assert record["name"] == "child" and record["attributes"] == {"treadle.step": 3}
    assert record["context"]["trace_id"] == f"0x{parent.get_span_context().trace_id:032x}"
    assert record["parent_id"] == f"0x{parent.get_span_context().span_id:016x}"
    assert record["end_time_ns"] >= record["start_time_ns"] > 0
    assert record["resource"]["attributes"]["service.name"] == "reward"


def test_services_trace_tasks_not_each_http_request(tmp_path):
    """FastAPI (0.165 and later) would add its own span, metrics and send wrapper to every
    request once a tracer provider exists, as a service's tracing makes one: it is off."""
    from treadle_common.config.settings import Settings
    from treadle_common.runtime.service import ServiceRuntime

    runtime = ServiceRuntime("svc", Settings(state_dir=tmp_path))
    assert not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    native = getattr(runtime.app, "_native_telemetry", None)
    assert native is None or not native.enabled()
