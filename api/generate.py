"""A generation from request to OpenAI answer: where its events come from (the model's
Ray Serve deployment, through Serve's HTTP proxy), and how they become a
`chat.completion` / `text_completion`, or the stream of their chunks as server-sent events
ending in `data: [DONE]`.

The first event is read before the response starts, so what the model server refuses (a
prompt past the context) is still a 400 with the error envelope, streaming or not. An
error after the stream has started arrives as a `data: {"error": ...}` event, which the
OpenAI SDK raises as an `APIError`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.concurrency import run_in_threadpool

from api.completion_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    PromptTokensDetails,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    TokenLogprob,
    ToolCall,
    ToolReading,
    TopLogprob,
    Usage,
)
from service.data.tools import CallReader, read_answer
from service.errors import InvalidRequest, NotAvailable, Unavailable
from service.serving.deployments import Serving, Target
from service.serving.generation import Generator
from service.serving.model_server import answer


class LocalBackend:
    """Events of a generation from generators in this process, one per model directory
    (its adapters load as their requests join the batch), each answering through the
    replicas' own `answer`: what a single process without Ray Serve uses (the API tests,
    `pstar bench primitives`). Serve's deploying, routing and scaling are left out."""

    def __init__(self, data_dir: Path, max_batch: int = 32) -> None:
        self.data_dir = data_dir
        self.max_batch = max_batch
        self.gens: dict[Path, Generator] = {}

    async def open(
        self, target: Target, payload: dict[str, Any], tenant: str
    ) -> AsyncIterator[dict]:
        """The events of `payload` on the target's generator, asked by `tenant` (a replica
        reuses a prompt's keys and values for the tenant that sent it only)."""
        payload = {**payload, "tenant": tenant}
        gen = self.gens.get(target.model_dir)
        if gen is None:
            gen = await run_in_threadpool(Generator, target.model_dir, max_batch=self.max_batch)
            gen = self.gens.setdefault(target.model_dir, gen)
        path = self.data_dir / target.adapter if target.adapter else None
        return answer(gen, payload, target.adapter, path)

    async def aclose(self) -> None:
        for g in self.gens.values():
            g.close()


class RayServeBackend:
    """Events of a generation from the target's Serve application (JSON lines)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        wait = serving.cfg.start_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._timeout = httpx.Timeout(connect=5.0, read=wait, write=30.0, pool=wait)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        return self._client

    async def open(
        self, target: Target, payload: dict[str, Any], tenant: str
    ) -> AsyncIterator[dict]:
        """As `LocalBackend.open`, through the target's Serve application."""
        url = await self.serving.endpoint_async(target)
        client = self.client()
        body = {**payload, "adapter": target.adapter, "tenant": tenant}
        req = client.build_request("POST", url, json=body)
        try:
            resp = await client.send(req, stream=True)
        except httpx.TimeoutException:
            why = await run_in_threadpool(self.serving.not_starting, target)
            raise Unavailable(
                f"model {target.model} did not answer within "
                f"{self.serving.cfg.start_timeout_s:.0f} s (no replica could start?): {why}"
            ) from None
        except httpx.HTTPError as e:
            raise Unavailable(
                f"Ray Serve's proxy for {target.model} is not reachable: {e}"
            ) from None
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            await resp.aclose()
            raise Unavailable(f"Ray Serve answered {resp.status_code} for {target.model}: {text}")
        return self._events(resp, target)

    async def _events(self, resp: httpx.Response, target: Target) -> AsyncIterator[dict]:
        try:
            async for line in resp.aiter_lines():
                if line.strip():
                    yield json.loads(line)
        except httpx.HTTPError as e:
            yield {"error": {"status": 503, "message": f"model {target.model} stopped: {e}"}}
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def refusal(err: dict[str, Any]) -> Exception:
    """The service error for an error event the model server sent first."""
    status = err.get("status", 500)
    if status == 400:
        return InvalidRequest(err["message"], param=err.get("param"), code=err.get("code"))
    if status == 404:  # the adapter's files went between the lookup and the load
        return NotAvailable(err["message"], param="model", code="model_not_found")
    if status == 503:
        return Unavailable(err["message"])
    return RuntimeError(err.get("message", "the model server failed"))


class Answer:
    """What one request's events add up to."""

    def __init__(self, n: int) -> None:
        self.texts = [""] * n
        self.reasons: list[str] = ["stop"] * n
        self.finishes: list[dict[str, Any]] = [{} for _ in range(n)]  # with log-probabilities
        self.prompt: dict[str, Any] = {}  # its text and tokens' log-probabilities (echo)
        self.usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)

    def add(self, ev: dict[str, Any]) -> None:
        if "text" in ev:
            self.texts[ev["i"]] += ev["text"]
        elif "finish" in ev:
            self.reasons[ev["i"]] = ev["finish"]
            self.finishes[ev["i"]] = ev
        elif "usage" in ev:
            self.usage = usage_of(ev["usage"])
        elif "prompt_logprobs" in ev:
            self.prompt.update(ev)
        elif "prompt_tokens" in ev:
            self.usage.prompt_tokens = ev["prompt_tokens"]
            if "prompt_text" in ev:
                self.prompt["prompt_text"] = ev["prompt_text"]


def usage_of(u: dict[str, int]) -> Usage:
    return Usage(
        prompt_tokens=u["prompt_tokens"],
        completion_tokens=u["completion_tokens"],
        total_tokens=u["prompt_tokens"] + u["completion_tokens"],
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.get("cached_tokens", 0)),
    )


async def collect(first: dict, events: AsyncIterator[dict], n: int) -> Answer:
    ans = Answer(n)
    ans.add(first)
    async for ev in events:
        if "error" in ev:
            raise refusal(ev["error"])
        ans.add(ev)
    return ans


def chat_completion(model: str, ans: Answer, reading: ToolReading | None = None) -> ChatCompletion:
    return ChatCompletion(
        id=f"chatcmpl-{secrets.token_hex(12)}",
        created=int(time.time()),
        model=model,
        choices=[
            _chat_choice(i, t, r, reading, f)
            for i, (t, r, f) in enumerate(zip(ans.texts, ans.reasons, ans.finishes, strict=True))
        ],
        usage=ans.usage,
    )


def _chat_choice(
    i: int, text: str, reason: str, reading: ToolReading | None, finish: dict[str, Any]
) -> ChatChoice:
    """One choice; with tools, the answer read for calls (the forced start of the turn
    first: the model continued it)."""
    logprobs = chat_logprobs(finish)
    if reading is None:
        message = AssistantMessage(content=text)
        return ChatChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs)
    said, calls, problems = read_answer(text, reading.tools, reading.parallel)
    message = AssistantMessage(
        content=said or None if calls else said,
        tool_calls=[ToolCall.model_validate(c) for c in calls] or None,
    )
    return ChatChoice(
        index=i,
        message=message,
        finish_reason=_reason(reason, bool(calls)),
        logprobs=logprobs,
        tool_call_problems=problems or None,
    )


def _tops(tops: list[Any], count: int) -> list[Any]:
    """Each token's likeliest ([text, logprob] pairs, or None), one per token."""
    return list(tops) + [None] * (count - len(tops))


def chat_logprobs(finish: dict[str, Any]) -> ChatLogprobs | None:
    """A choice's tokens with their log-probabilities, when the request asked."""
    if "token_texts" not in finish:
        return None
    texts, values = finish["token_texts"], finish["logprobs"]

    def top(pairs: Any) -> list[TopLogprob]:
        return [TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in pairs or ()]

    return ChatLogprobs(
        content=[
            TokenLogprob(token=t, logprob=v, bytes=list(t.encode()), top_logprobs=top(pairs))
            for t, v, pairs in zip(texts, values, _tops(finish["top"], len(texts)), strict=True)
        ]
    )


def _by_text(pairs: list[Any]) -> dict[str, float]:
    """The likeliest tokens by their text; tokens that decode alike (bytes of one
    character, each '\ufffd' alone) keep the likeliest's value."""
    out: dict[str, float] = {}
    for t, v in pairs:
        out.setdefault(t, v)
    return out


def text_logprobs(finish: dict[str, Any], prompt: dict[str, Any] | None) -> TextLogprobs | None:
    """A text choice's tokens (the prompt's first with `prompt`, for echo) in OpenAI's
    legacy shape, when the request asked."""
    if "token_texts" not in finish:
        return None
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[Any] = []
    if prompt is not None and "prompt_token_texts" in prompt:
        tokens += prompt["prompt_token_texts"]
        values += prompt["prompt_logprobs"]
        tops += _tops(prompt["prompt_top"], len(prompt["prompt_token_texts"]))
    tokens += finish["token_texts"]
    values += finish["logprobs"]
    tops += _tops(finish["top"], len(finish["token_texts"]))
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return TextLogprobs(
        tokens=tokens,
        token_logprobs=values,
        top_logprobs=[_by_text(p) if p is not None else None for p in tops],
        text_offset=offsets,
    )


def _reason(reason: str, called: bool) -> str:
    """OpenAI's finish reason: "tool_calls" when the model stopped after calling."""
    return "tool_calls" if called and reason == "stop" else reason


def text_completion(
    model: str, answers: list[Answer], echoed: list[str] | None = None
) -> TextCompletion:
    """The choices of each prompt's answer in order (prompt k's choice i at k*n + i); with
    `echoed`, each prompt's text (as the request gave it) before its answers'."""
    choices = []
    for k, ans in enumerate(answers):
        for t, r, f in zip(ans.texts, ans.reasons, ans.finishes, strict=True):
            head = echoed[k] if echoed is not None else ""
            logprobs = text_logprobs(f, ans.prompt if echoed is not None else None)
            choices.append(
                TextChoice(index=len(choices), text=head + t, finish_reason=r, logprobs=logprobs)
            )
    usage = usage_of(
        {
            "prompt_tokens": sum(a.usage.prompt_tokens for a in answers),
            "completion_tokens": sum(a.usage.completion_tokens for a in answers),
            "cached_tokens": sum(a.usage.cached_tokens for a in answers),
        }
    )
    return TextCompletion(
        id=f"cmpl-{secrets.token_hex(12)}",
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage,
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_chunks(
    chat: bool,
    model: str,
    n: int,
    include_usage: bool,
    events: AsyncIterator[dict],
    reading: ToolReading | None = None,
) -> AsyncIterator[bytes]:
    """The chunks of a streamed answer, as server-sent events, then `[DONE]`; with tools,
    each call as one delta (index, id, name and its whole arguments) once its block has
    ended and been checked, and the problems in the choice's last chunk."""
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    extra = {"usage": None} if include_usage else {}

    def chunk(
        index: int, text: str | None, reason: str | None, first: bool = False, logprobs=None
    ) -> bytes:
        """One choice's chunk; a choice's log-probabilities come with its last."""
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason}
        choice["logprobs"] = logprobs
        return _sse({**head, "choices": [choice], **extra})

    readers = [CallReader(reading.tools, reading.parallel) for _ in range(n)] if reading else []
    problems: list[list[str]] = [[] for _ in range(n)]

    def read(index: int, found: list[tuple[str, Any]]) -> list[bytes]:
        out = []
        for kind, value in found:
            if kind == "text":
                out.append(chunk(index, value, None))
            elif kind == "call":
                k = readers[index].calls - 1
                call = {"index": k, **value}
                delta = {"tool_calls": [call]}
                choice = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
                out.append(_sse({**head, "choices": [choice], **extra}))
            else:
                problems[index].append(value)
        return out

    if chat:
        for i in range(n):
            yield chunk(i, None, None, first=True)
    async for ev in events:
        if "text" in ev:
            if readers:
                for b in read(ev["i"], readers[ev["i"]].feed(ev["text"])):
                    yield b
            else:
                yield chunk(ev["i"], ev["text"], None)
        elif "finish" in ev:
            i, reason = ev["i"], ev["finish"]
            lp = chat_logprobs(ev) if chat else text_logprobs(ev, None)
            logprobs = lp.model_dump() if lp is not None else None
            if not readers:
                yield chunk(i, None if chat else "", reason, logprobs=logprobs)
                continue
            for b in read(i, readers[i].finish()):
                yield b
            last = {
                "index": i,
                "delta": {},
                "finish_reason": _reason(reason, readers[i].calls > 0),
                "logprobs": logprobs,
                "tool_call_problems": problems[i] or None,
            }
            yield _sse({**head, "choices": [last], **extra})
        elif "usage" in ev:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage_of(ev["usage"]).model_dump()})
        elif "error" in ev:
            err = ev["error"]
            yield _sse(
                {
                    "error": {
                        "message": err.get("message", "generation failed"),
                        "type": "server_error",
                        "param": None,
                        "code": err.get("code"),
                    }
                }
            )
            return
    yield b"data: [DONE]\n\n"
