"""`treadle trace`'s lanes and encodings on scripted spans: a slice lies only within its
ancestors' on a lane, concurrent siblings get lanes of their own, every lane's begins and
ends nest; which spans are a run's; OTLP/JSON's value encoding."""

from __future__ import annotations

import json

import pytest

from treadle_cli.trace_export import Span, lane_events, lanes, otlp_value, run_spans

pytestmark = pytest.mark.unit


def span(name, start, end, parent=None, trace="t1", service="rollout", **attrs) -> Span:
    return Span(name, trace, name, parent, start, end, "INTERNAL", "UNSET", attrs, [],
                {"service.name": service})  # fmt: skip


def test_siblings_that_overlap_get_lanes_and_children_nest_under_their_parent():
    task = span("task", 0, 100)
    a, b = span("ep-a", 10, 60, "task"), span("ep-b", 10, 60, "task")  # the same interval
    gen = span("gen-a", 20, 30, "ep-a")
    later = span("ep-c", 60, 90, "task")  # starts when a and b end
    other = span("other-trace", 5, 50, trace="t2")
    placed = lanes([later, gen, b, a, task, other])
    where = {s.name: i for i, lane in enumerate(placed) for s in lane}
    assert where["gen-a"] == where["ep-a"]  # within its own parent
    assert where["task"] in (where["ep-a"], where["ep-b"])  # one episode within the task
    assert where["ep-b"] != where["ep-a"]  # a sibling is never drawn inside a sibling
    assert where["other-trace"] not in (where["task"], where["ep-b"])
    assert where["ep-c"] in (where["task"], where["ep-b"])  # a freed lane is reused
    for lane in placed:
        depth = 0
        for _, kind, _ in lane_events(lane):
            depth += 1 if kind == "B" else -1
            assert depth >= 0
        assert depth == 0


def test_a_zero_length_span_begins_before_it_ends():
    events = lane_events([span("x", 5, 5)])
    assert [(t, k) for t, k, _ in events] == [(5, "B"), (5, "E")]


def test_a_runs_spans_are_its_tasks_publishes_and_swaps_of_its_models(tmp_path):
    def line(name, trace, parent=None, service="trainer", **attrs):
        return {
            "name": name,
            "context": {"trace_id": f"0x{trace:032x}", "span_id": f"0x{hash(name) & 0xFFFF:016x}"},
            "parent_id": parent,
            "kind": "INTERNAL",
            "start_time_ns": 1,
            "end_time_ns": 2,
            "status": "UNSET",
            "attributes": attrs,
            "events": [],
            "resource": {"attributes": {"service.name": service}},
        }

    records = [
        line("trainer.feed_task", 1, **{"treadle.run_id": "r1"}),
        line("rollout.task", 1, "0x1", service="rollout"),
        line("trainer.feed_task", 2, **{"treadle.run_id": "r2"}),
        line("trainer.publish", 3, **{"treadle.run_id": "r1", "treadle.model": "m1"}),
        line("rollout.swap", 4, service="rollout", **{"treadle.model": "m1"}),
        line("rollout.swap", 5, service="rollout", **{"treadle.model": "m2"}),
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(map(json.dumps, records)) + '\n{"cut sh')
    run = run_spans(tmp_path, "r1")
    assert sorted(int(s.trace_id, 16) for s in run.spans) == [1, 1, 3, 4]
    assert run.unreadable_lines == 1


def test_otlp_values_are_typed_as_otlp_json_writes_them():
    assert otlp_value(True) == {"boolValue": True}
    assert otlp_value(3) == {"intValue": "3"}  # int64 as a string in proto3 JSON
    assert otlp_value(0.5) == {"doubleValue": 0.5}
    assert otlp_value("x") == {"stringValue": "x"}
    assert otlp_value([1]) == {"arrayValue": {"values": [{"intValue": "1"}]}}
