"""Played episodes: an env that runs its own loop in the env-gateway (a `verifiers`
environment, say) calls the model back over the gateway's `Play` stream with the OpenAI
requests its client makes; they are answered here, each chat turn recorded into the episode's
transcript (`chat.SessionRecorder.attach`).

The requests cross the wire as HTTP (method, path, body) and their answers go back the same
way, since the env's own OpenAI client reads them: decoding and encoding them is this module's
whole job; the turns themselves are the chat core's (`chat.py`, through the OpenAI API).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from treadle_rollout.errors import OpenAIError, invalid_openai_request
from treadle_rollout.openai_api import OpenAIFrontend
from treadle_rollout.openai_types import ChatRequest
from treadle_rollout.transcript import Transcript

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class PlayedSampling:
    """The run's sampling, which a played episode's requests are answered with."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    model: str | None = None
    """The run's policy when it is an adapter (a LoRA run's); None: the engine's own."""


class PlayedEpisodes:
    def __init__(self, frontend: OpenAIFrontend):
        self.frontend = frontend

    @property
    def model_name(self) -> str:
        return self.frontend.engine.model_name

    def open(self, transcript: Transcript) -> str:
        """A session that records a played episode's chat turns into `transcript`: its id."""
        session_id = f"played-{uuid.uuid4().hex}"
        self.frontend.recorder.attach(session_id, transcript)
        return session_id

    def close(self, session_id: str) -> int:
        """Forget a played episode's session; its number of turns."""
        return self.frontend.recorder.detach(session_id)

    def request(self, method: str, path: str, body: bytes, run: PlayedSampling) -> ChatRequest:
        """The env's request as a chat request with the run's sampling: `temperature`,
        `top_p` and `seed` are the run's, `max_tokens` at most the run's, `model` the
        policy. Only chat completions reach the policy."""
        if method != "POST" or path.rstrip("/") != CHAT_PATH:
            raise OpenAIError(
                404,
                f"{method} {path}: a played episode reaches the policy through "
                f"POST {CHAT_PATH} only",
                code="not_found",
            )
        try:
            req = ChatRequest.model_validate_json(body)
        except ValidationError as exc:
            raise invalid_openai_request(exc.errors()) from exc
        asked = req.max_completion_tokens or req.max_tokens or run.max_tokens
        return req.model_copy(
            update={
                "model": run.model or self.model_name,
                "temperature": run.temperature,
                "top_p": run.top_p,
                "seed": run.seed,
                "max_tokens": min(asked, run.max_tokens),
                "max_completion_tokens": None,
            }
        )

    async def answer(
        self, session_id: str, method: str, path: str, body: bytes, run: PlayedSampling
    ) -> tuple[int, str, bytes]:
        """One model call of a played episode's env, answered as HTTP would be: (status,
        content type, body); the turn recorded in the episode's session."""
        try:
            result = await self.frontend.chat(self.request(method, path, body, run), session_id)
        except OpenAIError as exc:
            return exc.status, "application/json", json.dumps(exc.body()).encode()
        if isinstance(result, dict):
            return 200, "application/json", json.dumps(result).encode()
        return 200, "text/event-stream", "".join([event async for event in result]).encode()
