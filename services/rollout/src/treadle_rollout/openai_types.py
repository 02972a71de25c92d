"""The OpenAI API's request bodies, as rollout serves them.

Every field a request may carry is declared here, and each is either honoured or refused:
an unknown field is a 400 naming it (`extra="forbid"`), and a known field Treadle does not
implement is accepted only at its neutral value (e.g. `presence_penalty: 0`) and otherwise
refused with a 400 that names it (`SamplingFields.unsupported`). Nothing is dropped silently.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from treadle_rollout.errors import OpenAIError

MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 1_000_000
"""Text a request may bring (a prompt, one message's content): far past any context, and
short enough that tokenizing it cannot stall the server."""
MAX_BATCH_PROMPTS = 64
"""Prompts one completions request may batch (OpenAI's array `prompt`)."""
MAX_TOOLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ToolCallIn(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(
        None,
        ge=0,
        description="A streamed delta's position, which clients that assemble a call from "
        "chunks echo back (verifiers 0.4's chat loop): no meaning in a request, ignored",
    )

    def template(self) -> dict:
        """For the chat template: arguments as an object (what templates render)."""
        try:
            args: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": args},
        }


class ContentPart(Strict):
    type: Literal["text"] = Field(description="Only text parts: images and audio are refused")
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)]
        | None
    ) = None
    name: str | None = Field(None, max_length=256)
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    refusal: None = Field(None, description="Accepted as null (clients echo it back)")
    reasoning_content: Literal[""] | None = Field(
        None,
        description="Accepted empty or null: clients (verifiers) echo back the field of the "
        "reply, and this server's replies carry no reasoning",
    )

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template(self) -> dict:
        """The message as the chat template takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=65536)
    parameters: dict[str, JsonValue] | None = None
    strict: bool | None = Field(
        None,
        description="Accepted; arguments are not constrained to the schema (no "
        "guided decoding): check them as for any model",
    )


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, JsonValue] | None = None


StopField = (
    Annotated[str, Field(min_length=1, max_length=256)]
    | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
    | None
)


class SamplingFields(Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = Field(None, description="Text that ends the generation; cut from the text")
    stop_token_ids: list[int] | None = Field(
        None, max_length=64, description="Tokens that also end the generation (vLLM's field)"
    )
    skip_special_tokens: bool = Field(
        True, description="vLLM's field: leave special tokens out of the text"
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256, description="Accepted, not used")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> None:
        """Refuse, naming it, a field given a value this server does not implement."""
        if self.presence_penalty:
            _refuse("presence_penalty", "penalties are not implemented: send 0 or omit it")
        if self.frequency_penalty:
            _refuse("frequency_penalty", "penalties are not implemented: send 0 or omit it")
        if self.logit_bias:
            _refuse("logit_bias", "logit_bias is not implemented: omit it")
        if self.stream_options is not None and not self.stream:
            _refuse("stream_options", "stream_options needs stream=true")


def _refuse(param: str, why: str) -> None:
    raise OpenAIError(400, f"unsupported value for `{param}`: {why}", param=param)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = Field(None, description="Accepted, not used")
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs and not self.logprobs:
            _refuse("top_logprobs", "top_logprobs needs logprobs=true")
        fmt = self.response_format
        if (
            fmt is not None
            and fmt.type == "json_schema"
            and not isinstance((fmt.json_schema or {}).get("schema"), dict)
        ):
            _refuse("response_format", "json_schema needs `json_schema.schema`, a JSON schema")
        if self.store:
            _refuse("store", "this server does not store completions")
        if self.service_tier not in (None, "auto", "default"):
            _refuse("service_tier", "one tier: auto")
        if self.reasoning_effort is not None:
            _refuse("reasoning_effort", "not a reasoning-effort model: omit it")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            _refuse("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                _refuse("tool_choice", f"no tool named {self.tool_choice.function.name!r}")

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[TokenId], Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[
            list[Annotated[list[TokenId], Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    return_tokens_as_token_ids: bool = Field(
        False, description="Logprob tokens as `token_id:N`, end-of-turn included (token-exact)"
    )

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            _refuse("echo", "echo is not implemented")
        if self.suffix:
            _refuse("suffix", "insertion (suffix) is not implemented")
        if self.best_of is not None and self.best_of != self.n:
            _refuse("best_of", "best_of is not implemented: omit it or set it to n")


# --- responses (their shapes; the frontend builds them as dicts on its hot path) -------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str
    """The arguments as a JSON text, as OpenAI sends them."""


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """`POST /v1/chat/completions` without `stream` (with it: server-sent events of
    `chat.completion.chunk` objects, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str = Field(description="`treadle-v<policy version>`")
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """`POST /v1/completions` without `stream` (with it: server-sent events of
    `text_completion` chunks, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
