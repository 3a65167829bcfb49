"""Chat and text completions in OpenAI's shapes: the requests (what we take, and the
fields we refuse by name rather than ignore), the answers and the stream's chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.data.tools import (
    call_grammar,
    choice_problem,
    json_schema_problem,
    schema_problem,
    tool_calls_problem,
    tools_problem,
)

MAX_N = 8
MAX_STOP = 4
MAX_PROMPTS = 32  # prompts in one text completion request (a scoring harness's batch)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's; text completions' logprobs: 5

# fields OpenAI takes that we do not do: a request that sets one is refused naming it,
# not answered as if it had not been asked
UNSUPPORTED = {
    "functions": "function calls (the older form of tools; use tools)",
    "function_call": "function calls (the older form of tool_choice; use tool_choice)",
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

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only in an assistant message that calls tools
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (checked below)
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ValueError("only an assistant message has tool_calls")
            if problem := tool_calls_problem(self.tool_calls, "tool_calls", None):
                raise ValueError(problem)
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (it may be null only beside tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)

    def rendered(self) -> dict[str, Any]:
        """What the model server renders: the text, and the calls and the call answered."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


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
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name}: only 0 is supported by this service"
        return None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass(frozen=True)
class ToolReading:
    """How a chat request's answer is read for calls (`service.data.tools.CallReader`)."""

    tools: list[dict[str, Any]]
    parallel: bool


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None  # each answer token's log-probability
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    # {"name", "schema", "strict", "description"}}: the answer decoded to that JSON
    response_format: dict[str, Any] | None = None

    def format_problem(self) -> tuple[str, str] | None:
        """(field, why) of what is wrong with `response_format`, or None."""
        rf = self.response_format
        if rf is None or rf == {"type": "text"}:
            return None
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if (
                not isinstance(js, dict)
                or set(rf) != {"type", "json_schema"}
                or not isinstance(js.get("name"), str)
                or set(js) - {"name", "schema", "strict", "description"}
            ):
                return "response_format", (
                    'response_format must be {"type": "json_schema", "json_schema": {"name": '
                    '..., "schema": {...}}} (strict and description may be added)'
                )
            if why := json_schema_problem(js.get("schema", {})):
                return "response_format", f"response_format.json_schema.schema: {why}"
        elif rf != {"type": "json_object"}:
            return "response_format", (
                'response_format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "json_schema": {...}}'
            )
        if self.reading() is not None:
            return "response_format", (
                "response_format with tools is not supported by this service: ask with one or "
                'the other (or tool_choice: "none")'
            )
        return None

    def json_schema(self) -> str | None:
        """The schema the answer is decoded to (JSON text), or None."""
        rf = self.response_format or {}
        if rf.get("type") == "json_object":
            return json.dumps({"type": "object"})
        if rf.get("type") == "json_schema":
            return json.dumps(rf["json_schema"].get("schema") or {})
        return None

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def scoring_problem(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return None

    def scoring(self) -> dict[str, Any]:
        """What the model server sends back beside the text (see model_server.answer)."""
        if not self.logprobs:
            return {}
        return {"token_logprobs": True, "top_logprobs": self.top_logprobs or 0, "token_texts": True}

    def tool_problem(self) -> tuple[str, str] | None:
        """(field, why) of what is wrong with the request's tools, or None."""
        if self.tools is not None and (
            problem := tools_problem(self.tools) or schema_problem(self.tools)
        ):
            return "tools", problem
        if problem := choice_problem(self.tool_choice, self.tools):
            return "tool_choice", problem
        return None

    def reading(self) -> ToolReading | None:
        """How the answer is read for calls: None without tools or with tool_choice "none"
        (the model is then not shown the tools)."""
        if not self.tools or self.tool_choice == "none":
            return None
        parallel = self.parallel_tool_calls is not False
        return ToolReading(self.tools, parallel)

    def payloads(self) -> list[dict[str, Any]]:
        return [self.payload()]

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": [m.rendered() for m in self.messages], **self.scoring()}
        if (schema := self.json_schema()) is not None:
            out["json_schema"] = schema
        if reading := self.reading():
            out["tools"] = reading.tools
            grammar = call_grammar(reading.tools, self.tool_choice, reading.parallel)
            if grammar is not None:
                out["lark"] = grammar  # any call is decoded to its tool's schema
        return out


class CompletionRequest(Sampling):
    """A text completion: one prompt or a batch (strings, or token-id lists), each its own
    choices; `echo` answers the prompt too, and with `logprobs` its tokens' log-
    probabilities, which with `max_tokens: 0` is how a harness scores a text."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[int], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_PROMPTS),
        ]
    )
    max_tokens: Annotated[int | None, Field(ge=0)] = None  # 0 only with echo: scoring
    echo: bool | None = False
    # each token's log-probability and those of this many likeliest tokens
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    def scoring_problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens: 0 generates nothing; it needs echo: true (scoring)"
        if self.stream and self.echo and self.logprobs is not None:
            return "logprobs", (
                "logprobs: a streamed echo carries no log-probabilities of the prompt; ask "
                "without stream to score it"
            )
        return None

    def payloads(self) -> list[dict[str, Any]]:
        """One model-server request per prompt."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[dict[str, Any]] = [{"prompt": p}]
        elif isinstance(p[0], int):
            prompts = [{"prompt_ids": p}]
        else:
            prompts = [{"prompt_ids": x} if isinstance(x, list) else {"prompt": x} for x in p]
        extra: dict[str, Any] = {"echo": bool(self.echo)}
        if self.logprobs is not None:
            extra.update(
                token_logprobs=True,
                prompt_logprobs=bool(self.echo),
                top_logprobs=self.logprobs,
                token_texts=True,
            )
        return [{**x, **extra} for x in prompts]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose keys and values a replica had kept


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int:
        d = self.prompt_tokens_details
        return d.cached_tokens if d is not None else 0


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, checked against the tool's parameters


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the answer is only calls
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None = None
    # ours, beside OpenAI's fields: each `<tool_call>` the model wrote that was not
    # returned as a call, and why (not JSON, no such tool, arguments off the schema)
    tool_call_problems: list[str] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TextLogprobs(BaseModel):
    """OpenAI's legacy shape: per token, its text, log-probability (null for a prompt's
    first), the likeliest tokens' (null there too) and where it starts in `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: TextLogprobs | None = None


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
