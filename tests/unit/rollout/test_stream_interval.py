from types import SimpleNamespace

import pytest

from treadle_rollout import chat, errors, openai_api, openai_stream


def frontend(interval_ms: float, events_per_s: float) -> openai_api.OpenAIFrontend:
    tokenizer = SimpleNamespace(eos_token_id=0, chat_template=None)
    return openai_api.OpenAIFrontend(
        SimpleNamespace(),
        chat.SessionRecorder(tokenizer),
        stream_interval_ms=interval_ms,
        stream_events_per_s=events_per_s,
    )


def test_many_open_streams_share_a_bounded_event_rate():
    api = frontend(10, 500).generator
    assert api.interval(1) == pytest.approx(0.010)  # one stream: the configured interval
    api.open_streams = 31
    assert api.interval(1) == pytest.approx(32 / 500)  # 32 streams: 500 events/s together
    assert frontend(10, 0).generator.interval(64) == pytest.approx(0.010)  # 0: no bound


async def _writes(one, count: int, include_usage: bool = True) -> list[str]:
    header = openai_stream.ChunkHeader(
        "chat.completion.chunk", SimpleNamespace(model_name="m", version=1)
    )
    return [w async for w in openai_stream.sse(one, count, header, include_usage)]


async def test_chunks_ready_together_go_out_in_one_write():
    """The role's chunk with the first content, and a choice's last chunks with the usage
    and [DONE]: each write costs the serving loop, and the engine shares its interpreter."""

    async def one(index: int, counts: list):
        yield ['"role"', '"a"']
        yield []  # nothing new this time: no write
        yield ['"b"']
        counts.append((3, 2))
        yield openai_stream.Last(['"c"', '"finish"'])

    writes = await _writes(one, 1)
    assert writes[:2] == ['data: "role"\n\ndata: "a"\n\n', 'data: "b"\n\n']
    assert len(writes) == 3
    events = writes[2].split("\n\n")[:-1]
    assert events[:2] == ['data: "c"', 'data: "finish"']
    assert '"prompt_tokens": 3' in events[2] and '"completion_tokens": 2' in events[2]
    assert events[3] == "data: [DONE]"


async def test_several_choices_each_send_their_last_chunks_and_an_error_ends_the_stream():
    async def one(index: int, counts: list):
        yield [f'"{index}"']
        counts.append((1 if index == 0 else 0, 1))
        yield openai_stream.Last([f'"end{index}"'])

    writes = await _writes(one, 2, include_usage=False)
    assert sorted(writes[:-1]) == [
        'data: "0"\n\n',
        'data: "1"\n\n',
        'data: "end0"\n\n',
        'data: "end1"\n\n',
    ]
    assert writes[-1] == "data: [DONE]\n\n"

    async def failing(index: int, counts: list):
        yield ['"a"']
        raise errors.OpenAIError(400, "bad stop", param="stop")

    writes = await _writes(failing, 1)
    assert writes[0] == 'data: "a"\n\n'
    assert '"bad stop"' in writes[1] and writes[1].endswith("data: [DONE]\n\n")


async def test_pieces_go_at_once_until_the_client_has_some_text():
    """A first piece that shows the client nothing (part of a character, a held-back stop
    string's start) must not hold the first text back a whole interval: the interval
    applies once the client has some text; the last piece goes at once."""
    from treadle_rollout.engines.base import Generation, Sampling

    pieces = [Generation([t], [0.0], [1], "") for t in (1, 2, 3)]
    pieces.append(Generation([4], [0.0], [1], "length"))

    class Engine:
        async def stream(self, prompt, sampling):
            for piece in pieces:
                yield piece

    api = frontend(60_000, 0).generator  # a minute
    api.engine = Engine()  # type: ignore[assignment]
    got: list[list[int]] = []

    def shown() -> bool:  # the second piece completes a character
        return [2] in got

    async for piece in api.stream([0], Sampling(1.0, 1.0, 4), shown):
        got.append(piece.tokens)
    assert got == [[1], [2], [3, 4]]
