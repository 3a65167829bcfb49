"""Chat and text completions in OpenAI's shapes: the requests (what we take, and the
fields we refuse by name rather than ignore), the answers and the stream's chunks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 8
MAX_STOP = 4

# fields OpenAI takes that we do not do: a request that sets one is refused naming it,
# not answered as if it had not been asked
UNSUPPORTED = {
    "tools": "tool calls",
    "functions": "function calls",
    "tool_choice": "tool calls",
    "function_call": "function calls",
    "response_format": "structured output",
    "audio": "audio output",
    "logit_bias": "logit bias",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "best_of": "best_of",
    "suffix": "suffix (insertion)",
}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=512)]
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    n: Annotated[int | None, Field(ge=1, le=MAX_N)] = None
    stop: (
        str
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    # a 64-bit seed, as torch's generators take it
    seed: Annotated[int | None, Field(ge=-(2**63), le=2**64 - 1)] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str | None, Field(max_length=256)] = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, str) and not v:
            raise ValueError("a stop string must not be empty")
        return v

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first field set that this service does not do."""
        extra = self.model_extra or {}
        for name, what in UNSUPPORTED.items():
            if extra.get(name) not in (None, [], {}, "text", {"type": "text"}):
                return name, f"{name}: {what} is not supported by this service"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs: log probabilities are not returned by this service"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name}: only 0 is supported by this service"
        if getattr(self, "echo", False):
            return "echo", "echo: returning the prompt is not supported by this service"
        return None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def payload(self) -> dict[str, Any]:
        return {"messages": [{"role": m.role, "content": m.text()} for m in self.messages]}


class CompletionRequest(Sampling):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
    )
    echo: bool | None = False

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    def payload(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            return {"prompt_ids": p}
        return {"prompt": p[0] if isinstance(p, list) else p}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool
