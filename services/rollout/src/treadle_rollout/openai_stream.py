"""Pieces of the OpenAI answers' wire form: usage, stop strings, joining engine pieces,
decoding a streamed turn (`Decoder`, which holds text back while it may become a stop string
or a tool call), and server-sent events (`ChunkHeader`, `sse`, `merge`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from treadle_rollout.engines.base import Generation
from treadle_rollout.errors import OpenAIError
from treadle_rollout.sse import Final

if TYPE_CHECKING:
    from treadle_rollout.chat import Reply
    from treadle_rollout.engines.base import Engine
    from treadle_rollout.generation import PolicyGenerator


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def cut(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string (OpenAI returns the text before it)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def joined(pieces: list[Generation]) -> Generation:
    return Generation(
        [t for p in pieces for t in p.tokens],
        [x for p in pieces for x in p.logprobs],
        [v for p in pieces for v in p.versions],
        pieces[-1].finish_reason if pieces else "length",
        [t for p in pieces for t in p.top_logprobs],
    )


class Decoder:
    """One streamed choice's text: what may be sent so far, and the rest at the end.

    Held back: an incomplete UTF-8 character, the last characters that may begin a stop
    string, and everything from where a tool call may begin (sent, parsed, at the end)."""

    def __init__(self, generator: PolicyGenerator, prefix: str, stops, parser, skip_special):
        self.generator, self.prefix, self.stops, self.parser = generator, prefix, stops, parser
        self.skip_special = skip_special
        self.tokens: list[int] = []
        self.final = False
        self.sent = 0
        """Characters of the text already sent."""

    def text(self) -> str:
        """The whole text so far (after the prefix), cut at a stop string."""
        body = self.generator.decode(
            self.generator.visible(self.tokens, self.final), self.skip_special
        )
        return cut(self.prefix + body, self.stops)

    def add(self, tokens: list[int], final: bool) -> str:
        """Take new tokens; the text that may be sent now."""
        self.tokens += tokens
        self.final = final
        text = self.text()
        limit = len(text)
        if not final:
            limit = len(text.rstrip("\ufffd"))
            if self.stops:
                limit = min(limit, len(text) - max(len(s) for s in self.stops) + 1)
        if self.parser is not None:
            start = self.parser.start
            at = text.find(start)
            if at >= 0:
                limit = min(limit, at)
            elif not final:
                for k in range(len(start) - 1, 0, -1):
                    if text.endswith(start[:k]):
                        limit = min(limit, len(text) - k)
                        break
            if final:
                return ""  # the end is read as a whole (`rest`)
        if limit <= self.sent:
            return ""
        out, self.sent = text[self.sent : limit], limit
        return out

    def rest(self, reply: Reply | None) -> str:
        """At the end: the text not yet sent (with tool calls: their content only)."""
        text = self.text()
        if reply is not None and reply.calls:
            text = reply.content or ""
        if len(text) <= self.sent:
            return ""
        out, self.sent = text[self.sent :], len(text)
        return out


class ChunkHeader:
    """Chunks of one streamed response: one id and creation time for all."""

    def __init__(self, kind: str, engine: Engine):
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        self.base = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": engine.model_name,
            "system_fingerprint": f"treadle-v{engine.version}",
        }

        self._head = json.dumps(self.base)[:-1] + ', "choices": '
        """The fields every chunk shares, serialized once."""

    def _chunk(self, choices: list[dict], tail: str = "") -> str:
        return f"{self._head}{json.dumps(choices)}{tail}}}"

    def chat(self, index: int, delta: dict, *, logprobs=None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def text(self, index: int, text: str, logprobs, *, finish: str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def usage(self, prompt: int, completion: int) -> str:
        return self._chunk([], f', "usage": {json.dumps(usage(prompt, completion))}')


def event(data: dict | str) -> str:
    """One server-sent event (`data` as JSON, unless already serialized)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


Chunks = list[str]
"""Chunks (serialized JSON) ready at the same time: they go out in one write."""


class Last(list[str]):
    """A choice's last chunks (the one with its finish reason last)."""


async def sse(one, count: int, header: ChunkHeader, include_usage: bool) -> AsyncIterator[str]:
    """The chunks of `one(index, counts)` for each choice (several at once) as SSE events,
    then the usage chunk (if asked) and `[DONE]`; an error after the first event is sent as
    an error event. Chunks ready together go out together, and with one choice its last
    chunks, the usage and `[DONE]` too: each write costs the serving event loop (and the
    engine, which shares its interpreter) about as much as building the chunk. Closing the
    stream cancels the generations."""
    counts: list[tuple[int, int]] = []
    chunks: AsyncGenerator[Chunks, None] = (
        one(0, counts) if count == 1 else merge([one(i, counts) for i in range(count)])
    )
    held = ""
    try:
        async with contextlib.aclosing(chunks):
            async for group in chunks:
                events = "".join(event(chunk) for chunk in group)
                if count == 1 and isinstance(group, Last):
                    held = events  # the last: it goes out with the usage and [DONE]
                elif events:
                    yield events
    except OpenAIError as exc:
        held += event(exc.body())
    except Exception as exc:  # the stream has begun: the error goes in it
        held += event(OpenAIError(500, f"generation failed: {exc}", type_="server_error").body())
    else:
        if include_usage:
            held += event(header.usage(sum(p for p, _ in counts), sum(c for _, c in counts)))
    yield Final(held + event("[DONE]"))


async def merge(
    generators: list[AsyncGenerator[Chunks, None]],
) -> AsyncGenerator[Chunks, None]:
    """Items of several async generators as they come; the first error ends it."""
    out: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(gen: AsyncGenerator[Chunks, None]) -> None:
        try:
            async for item in gen:
                await out.put((item, None))
            await out.put((end, None))
        except Exception as exc:
            await out.put((end, exc))

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    try:
        left = len(tasks)
        while left:
            item, exc = await out.get()
            if exc is not None:
                raise exc
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
