from types import SimpleNamespace

import pytest

from treadle_rollout import openai_api


def frontend(interval_ms: float, events_per_s: float) -> openai_api.OpenAIFrontend:
    tokenizer = SimpleNamespace(eos_token_id=0, chat_template=None)
    return openai_api.OpenAIFrontend(
        SimpleNamespace(),
        openai_api.SessionRecorder(tokenizer),
        stream_interval_ms=interval_ms,
        stream_events_per_s=events_per_s,
    )


def test_many_open_streams_share_a_bounded_event_rate():
    api = frontend(10, 500)
    assert api._interval(1) == pytest.approx(0.010)  # one stream: the configured interval
    api.open_streams = 31
    assert api._interval(1) == pytest.approx(32 / 500)  # 32 streams: 500 events/s together
    assert frontend(10, 0)._interval(64) == pytest.approx(0.010)  # 0: no bound
