"""The pieces of rollout's streamed-request path that cut its latency: frames read in the
callback that received them (`wire.FrameProtocol`), the SSE response that streams in the
request's task (`sse.EventStream`), the fast tokenizer path (`transcript.encode`) and the
engine's finish callback (`HFEngine.submit(on_finish=)`, `on_delivered`)."""

from __future__ import annotations

import asyncio
import json
import socket

import msgpack
import pytest
from transformers import AutoTokenizer

from treadle_rollout.engines import wire
from treadle_rollout.engines.base import Sampling
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.sse import EventStream, Final
from treadle_rollout.transcript import encode

pytestmark = pytest.mark.unit


# -- frames -----------------------------------------------------------------------------------
async def test_frames_split_anywhere_arrive_whole_and_in_order():
    ours, theirs = socket.socketpair()
    got: list[list[dict]] = []
    transport, conn = await wire.connect(ours, got.append)
    frames = [[{"id": i, "t": list(range(i * 7))}] for i in range(30)]
    data = b"".join(wire.encode_frame(f) for f in frames)
    for start in range(0, len(data), 13):  # 13-byte writes: every boundary falls mid-frame
        theirs.sendall(data[start : start + 13])
        await asyncio.sleep(0)
    for _ in range(200):
        if len(got) == len(frames):
            break
        await asyncio.sleep(0.01)
    assert got == frames
    theirs.close()
    assert await asyncio.wait_for(conn.closed, 5) is None  # closed by the other side
    transport.close()


async def test_a_malformed_frame_ends_the_connection_with_its_error():
    ours, theirs = socket.socketpair()
    got: list[list[dict]] = []
    _, conn = await wire.connect(ours, got.append)
    body = msgpack.packb({"not": "an array"})
    theirs.sendall(len(body).to_bytes(4, "big") + body)
    error = await asyncio.wait_for(conn.closed, 5)
    assert isinstance(error, ValueError) and "array" in str(error)
    assert got == []
    theirs.close()


async def test_an_oversized_frame_length_ends_the_connection():
    ours, theirs = socket.socketpair()
    _, conn = await wire.connect(ours, lambda _: None)
    theirs.sendall((wire.MAX_FRAME + 1).to_bytes(4, "big"))
    error = await asyncio.wait_for(conn.closed, 5)
    assert isinstance(error, ValueError) and "longer than" in str(error)
    theirs.close()


async def test_an_immediate_outbox_writes_each_message_at_once():
    class Writer:
        def __init__(self):
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return False

    writer = Writer()
    now, later = wire.Outbox(writer, immediate=True), wire.Outbox(Writer())
    now.send({"id": 1})
    now.send({"id": 2})
    assert [wire.decode_body(w[4:]) for w in writer.writes] == [[{"id": 1}], [{"id": 2}]]
    later.send({"id": 1})
    later.send({"id": 2})
    assert later.writer.writes == []  # type: ignore[attr-defined]
    later.flush()
    assert [wire.decode_body(w[4:]) for w in later.writer.writes] == [  # type: ignore[attr-defined]
        [{"id": 1}, {"id": 2}]
    ]


# -- the SSE response -------------------------------------------------------------------------
class Client:
    """A scripted ASGI server side: records what the response sends; `leave()` makes the
    next `receive` say the client disconnected."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.gone.set()


SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


async def test_the_last_events_end_the_body_in_one_message():
    async def events():
        yield "data: 1\n\n"
        yield Final("data: 2\n\ndata: [DONE]\n\n")

    client = Client()
    await EventStream(events())(SCOPE, client.receive, client.send)
    assert client.sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    bodies = [(m["body"], m["more_body"]) for m in client.sent[1:]]
    assert bodies == [(b"data: 1\n\n", True), (b"data: 2\n\ndata: [DONE]\n\n", False)]


async def test_a_stream_without_final_events_still_ends_its_body():
    async def events():
        yield "data: 1\n\n"

    client = Client()
    await EventStream(events())(SCOPE, client.receive, client.send)
    assert [(m["body"], m["more_body"]) for m in client.sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"", False),
    ]


async def test_a_client_that_leaves_cancels_the_events_and_the_response_returns():
    closed = asyncio.Event()

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(3600)  # a generation that would run on
            yield "never"
        finally:
            closed.set()

    client = Client()
    response = asyncio.create_task(EventStream(events())(SCOPE, client.receive, client.send))
    while len(client.sent) < 2:
        await asyncio.sleep(0.01)
    client.leave()
    await asyncio.wait_for(response, 5)  # returns: no error, no CancelledError
    assert closed.is_set()  # the generator's finally ran (it cancels the generation)
    assert not response.cancelled()
    assert all(m.get("body") != b"never" for m in client.sent)


async def test_cancelling_the_request_task_is_not_taken_for_a_client_leaving():
    async def events():
        yield "data: 1\n\n"
        await asyncio.sleep(3600)
        yield "never"

    client = Client()
    response = asyncio.create_task(EventStream(events())(SCOPE, client.receive, client.send))
    while len(client.sent) < 2:
        await asyncio.sleep(0.01)
    response.cancel()  # the server shutting down, say: the cancel propagates
    with pytest.raises(asyncio.CancelledError):
        await response


# -- the tokenizer ----------------------------------------------------------------------------
def test_the_fast_encoder_gives_the_tokenizers_ids(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = [
        "",
        "12+36= what is the answer ",
        "  leading and trailing spaces  \n\n",
        "unicode: héllo wörld 東京 🙂",
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        ),
        (tokenizer.eos_token or "") + "text after a special token",
    ]
    for text in texts:
        assert encode(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_an_opening_renders_and_tokenizes_once_and_stays_exact(tiny_model, monkeypatch):
    from treadle_rollout import transcript

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    renders: list[int] = []
    real = transcript.render
    monkeypatch.setattr(transcript, "render", lambda *a: renders.append(1) or real(*a))
    monkeypatch.setattr(transcript, "_OPENINGS", type(transcript._OPENINGS)())
    monkeypatch.setattr(transcript, "_opening_tokens", 0)
    messages = [{"role": "user", "content": "12+36= what is the answer"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    for suffix in ("", "<tool_call>"):
        for _ in range(3):
            text, tokens = transcript.opening(tokenizer, messages, tools, suffix)
            assert text == real(tokenizer, messages, tools) + suffix
            assert list(tokens) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(renders) == 2  # once per distinct opening
    # the token budget holds: the oldest openings leave first
    asked = len(transcript.opening(tokenizer, [{"role": "user", "content": "question 0"}])[1])
    monkeypatch.setattr(transcript, "MAX_OPENING_TOKENS", 8 * (asked + 1))
    for i in range(20):
        transcript.opening(tokenizer, [{"role": "user", "content": f"question {i}"}])
    assert transcript._opening_tokens <= transcript.MAX_OPENING_TOKENS
    assert transcript._opening_tokens == sum(len(t) for _, t in transcript._OPENINGS.values())
    kept = [json.loads(key[1])[0][0]["content"] for key in transcript._OPENINGS]
    assert kept == [f"question {i}" for i in range(20 - len(kept), 20)]


# -- the engine's finish callback -------------------------------------------------------------
async def test_on_finish_gets_the_generation_in_the_call_that_delivers_it(tiny_model):
    engine = HFEngine(tiny_model, "tiny")
    events: list[str] = []
    finished = []
    engine.on_delivered = lambda: events.append("delivered")

    def on_finish(gen) -> None:
        finished.append(gen)
        events.append("finish")

    prompt = engine.tokenizer("1+3= what")["input_ids"]
    future = engine.submit(prompt, Sampling(1.0, 1.0, 6, seed=1), None, on_finish)
    future.add_done_callback(lambda _: events.append("future callbacks"))
    gen = await future
    await asyncio.sleep(0)
    assert finished == [gen] and gen.tokens
    # the finish and the step's delivery in one call; the future's callbacks a turn later
    assert events.index("finish") < events.index("future callbacks")
    assert events[events.index("finish") + 1] == "delivered"
    await engine.close()
