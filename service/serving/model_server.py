"""The Ray Serve deployment that answers for one model directory (a base model with the
LoRA adapters of its fine-tunes, or one full fine-tune): `build(args)` is the application
builder `service.serving.deployments` names in the Serve config it deploys.

A replica holds one `Generator`. A request names its adapter (`adapter`: its directory,
relative to the data dir); the generator loads it as the request joins the batch if it
is not in memory, and keeps at most `max_adapters`, the least recently used one out once
no row decodes with it. (Serve's model multiplexing would route each request to a replica
holding its adapter, but its router backs off between matching attempts: under `pstar
bench serve` it cost 4-streams runs of adapters 3x their tokens/s and seconds of time to
first token on a single replica. Without it, several replicas each keep their own LRU.)

The request is JSON (`prompt_ids` or `messages` or `prompt`, and the sampling fields) and
the answer streams as JSON lines: first `{"prompt_tokens": n}` (or `{"error": ...}`, a
request the model cannot take, such as one past its context), then
`{"i": choice, "text": piece}`, `{"i": choice, "finish": reason, "tokens": [...]}`, and
last `{"usage": {...}}`. Training sessions' samplers (service.sessions.sampling) also send
`top_k`, `stop_token_ids`, `ignore_eos`, `token_logprobs` (each finish then carries its
tokens' `logprobs`) and `prompt_logprobs` (a `{"prompt_logprobs": [null, ...]}` line
before the first piece). A client that goes away cancels its rows at the next step.

Each replica writes what it holds to `<data>/serving/<app>/<replica>.json` every
second (the control plane's `/v1/models` and dashboard read them): the adapters it has
loaded, its rows in flight, its decode steps; and drops adapters whose directory is gone
(a deleted model) on the same beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from service.data.tools import ToolFormatError
from service.serving.generation import (
    Done,
    Finish,
    Generator,
    PromptLogprobs,
    Request,
    SamplingParams,
    Token,
)
from service.serving.guided import grammar_of

log = logging.getLogger(__name__)

STATUS_EVERY_S = 1.0  # a small file: /v1/models is at most this much behind


def confined(data_dir: Path, relative: str) -> Path:
    """`data_dir / relative`, refused if it leaves the data dir."""
    p = (data_dir / relative).resolve()
    if not p.is_relative_to(data_dir.resolve()):
        raise ValueError(f"adapter path {relative!r} is outside the data directory")
    return p


def sampling(body: dict[str, Any], prompt_tokens: int, context: int) -> SamplingParams:
    """The request's sampling parameters; `max_tokens` defaults to what the context has left."""
    room = context - prompt_tokens
    max_tokens = body.get("max_tokens")
    if max_tokens is None:  # what the context has left, up to the service's default cap
        max_tokens = min(room, int(body.get("default_max_tokens") or room))
    return SamplingParams(
        max_tokens=int(max_tokens),
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        n=int(body.get("n", 1)),
        seed=body.get("seed"),
        stop=tuple(body.get("stop") or ()),
        top_k=int(body.get("top_k") or 0),
        stop_tokens=tuple(int(t) for t in body.get("stop_token_ids") or ()),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=bool(body.get("token_logprobs", False)),
        prompt_logprobs=bool(body.get("prompt_logprobs", False)),
        prompt_logprobs_last_n=body.get("prompt_logprobs_last_n"),
        top_logprobs=int(body.get("top_logprobs") or 0),
        grammar=grammar_of(body),
    )


def context_error(prompt_tokens: int, max_tokens: int | None, context: int, field: str):
    """The error for a request past the model's context, or None."""
    asked = prompt_tokens + (max_tokens or 0)
    if prompt_tokens < context and asked <= context:
        return None
    return {
        "status": 400,
        "code": "context_length_exceeded",
        "param": field if prompt_tokens >= context else "max_tokens",
        "message": f"This model's maximum context length is {context} tokens. However, you "
        f"requested {asked} tokens ({prompt_tokens} in the {field}, {max_tokens or 0} in "
        "the completion). Please reduce the length of the prompt or of max_tokens.",
    }


async def answer(
    gen: Generator,
    body: dict[str, Any],
    adapter: str | None = None,
    adapter_path: Path | None = None,
):
    """The events of one request on `gen` (the module docstring's lines, as dicts), with
    the adapter at `adapter_path` (loaded as the request joins the batch, if it is not in
    memory). Leaving early (a client gone) cancels the request's rows.

    For scoring: `echo` adds the prompt's text to the first event; `token_texts` adds
    each token's text beside its id and log-probabilities (and the `top_logprobs`
    likeliest ones'); `max_tokens` 0 generates nothing (one token is decoded and
    dropped: the prompt's log-probabilities come from the prefill)."""
    if body.get("max_tokens") == 0:
        body = {**body, "max_tokens": 1, "score_only": True}
    score_only = bool(body.get("score_only"))
    texts = bool(body.get("token_texts"))

    def text(t: int) -> str:
        return str(gen.tokenizer.decode([t]))

    def top_texts(top: Any) -> list[Any]:
        return [[[text(t), v] for t, v in at] if at else None for at in top]

    if "messages" in body:
        try:
            ids, field = gen.render(body["messages"], body.get("tools")), "messages"
        except ToolFormatError as e:
            yield {"error": {"status": 400, "param": "tools", "code": "invalid_value",
                             "message": str(e)}}  # fmt: skip
            return
    elif "prompt_ids" in body:
        ids, field = list(body["prompt_ids"]), "prompt"
    else:
        ids, field = gen.encode(body.get("prompt", "")), "prompt"
    try:
        grammar = grammar_of(body)
        why = gen.guide.problem(grammar) if grammar is not None else None
    except ValueError as e:
        why = str(e)
    if why:
        param = "tools" if body.get("lark") else "response_format"
        message = f"{param}: the answer cannot be decoded to this schema: {why}"
        yield {"error": {"status": 400, "param": param, "code": "invalid_value",
                         "message": message}}  # fmt: skip
        return
    vocab = gen.vocab_size
    if (bad := next((t for t in ids if not 0 <= t < vocab), None)) is not None:
        yield {
            "error": {
                "status": 400,
                "param": "prompt",
                "code": "invalid_value",
                "message": f"prompt: token id {bad} is not in the model's vocabulary "
                f"(0 to {vocab - 1})",
            }
        }
        return
    if not ids:  # an empty prompt: generation starts from the start of a text
        ids = [gen.tokenizer.bos_token_id or gen.tokenizer.eos_token_id or 0]
    err = context_error(len(ids), body.get("max_tokens"), gen.context, field)
    if err:
        yield {"error": err}
        return
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(ev: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ev)

    params = sampling(body, len(ids), gen.context)
    tenant = body.get("tenant")  # the backend's (api.generate): whose prompts it may reuse
    req = Request(ids, params, emit, adapter, adapter_path, str(tenant) if tenant else None)
    gen.submit(req)
    first: dict[str, Any] = {"prompt_tokens": len(ids)}
    if body.get("echo"):
        first["prompt_text"] = gen.tokenizer.decode(ids)
    yield first
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, Token):
                if not score_only:
                    yield {"i": ev.index, "text": ev.text}
            elif isinstance(ev, Finish):
                fin: dict[str, Any] = {
                    "i": ev.index,
                    "finish": "length" if score_only else ev.reason,
                    "tokens": [] if score_only else list(ev.tokens),
                }
                if params.logprobs:
                    fin["logprobs"] = [] if score_only else list(ev.logprobs)
                    if texts:
                        fin["token_texts"] = [text(t) for t in fin["tokens"]]
                        fin["top"] = [] if score_only else top_texts(ev.top)
                        if field == "messages" and _ended_turn(gen, ev):
                            # a chat answer's tokens are its message's, as OpenAI lists
                            # them: the end-of-turn token that closed it is not one
                            for key in ("logprobs", "token_texts", "top"):
                                fin[key] = fin[key][:-1]
                yield fin
            elif isinstance(ev, PromptLogprobs):  # NaN, not JSON: the first is null
                got: dict[str, Any] = {"prompt_logprobs": [None, *ev.values[1:]]}
                if texts:
                    got["prompt_token_texts"] = [text(t) for t in ids]
                    got["prompt_top"] = top_texts(ev.top) if ev.top else [None] * len(ids)
                yield got
            elif isinstance(ev, Done):
                usage = {
                    "prompt_tokens": ev.prompt_tokens,
                    "completion_tokens": 0 if score_only else ev.completion_tokens,
                    "cached_tokens": ev.cached_tokens,
                }
                yield {"usage": usage}
                return
            else:
                status = 404 if isinstance(ev, LookupError) else 500
                yield {"error": {"status": status, "message": str(ev)}}
                return
    finally:
        req.cancelled = True  # a client gone mid-answer frees its rows


def _ended_turn(gen: Generator, ev: Finish) -> bool:
    """Whether `ev`'s last token is an end-of-turn token that stopped it."""
    return ev.reason == "stop" and bool(ev.tokens) and ev.tokens[-1] in gen.eos


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def build(args: dict[str, Any]):
    """The Serve application for `args["model_dir"]` (see the module's docstring)."""
    from ray import serve
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse

    @serve.deployment(name="model")
    class ModelServer:
        def __init__(self, args: dict[str, Any]) -> None:
            import torch

            from service.serving.generation import default_dtype

            logging.basicConfig(level=logging.INFO)
            self.app = args["app"]
            self.data_dir = Path(args["data_dir"])
            device = "cuda" if torch.cuda.is_available() else "cpu"
            torch.set_num_threads(int(args.get("threads") or os.cpu_count() or 1))
            self.gen = Generator(
                Path(args["model_dir"]),
                dtype=default_dtype(device),
                device=device,
                max_batch=int(args.get("max_batch", 32)),
                max_adapters=int(args.get("max_adapters", 8)),
                prefix_cache_bytes=int(args.get("prefix_cache_mb", 512)) << 20,
            )
            ctx = serve.get_replica_context()
            self.replica = ctx.replica_tag if ctx else f"pid{os.getpid()}"
            self.status_file = self.data_dir / "serving" / self.app / f"{self.replica}.json"
            self.started = time.time()
            self.model_dir = args["model_dir"]
            self._beat = asyncio.get_event_loop().create_task(self._status_loop())

        async def __call__(self, request: HttpRequest):
            if request.method == "GET":
                return JSONResponse(self._status())
            body = await request.json()
            key = body.get("adapter") or None
            try:
                path = confined(self.data_dir, key) if key else None
            except ValueError as e:
                err = {"status": 400, "param": "model", "message": str(e)}
                return StreamingResponse(iter([_line({"error": err})]))
            lines = (_line(ev) async for ev in answer(self.gen, body, key, path))
            return StreamingResponse(lines, media_type="application/x-ndjson")

        def _status(self) -> dict[str, Any]:
            return {
                "app": self.app,
                "replica": self.replica,
                "model_dir": self.model_dir,
                "node": socket.gethostname(),
                "pid": os.getpid(),
                "device": str(self.gen.device),
                "started_at": int(self.started),
                "updated_at": time.time(),
                **self.gen.stats(),
            }

        def _write_status(self) -> None:
            with contextlib.suppress(OSError):
                self.status_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.status_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(self._status()))
                tmp.replace(self.status_file)

        async def _status_loop(self) -> None:
            while True:
                for key, path in list(self.gen.adapters.items()):
                    if not path.exists():  # its model was deleted: out of memory too
                        self.gen.unload_adapter(key)
                self._write_status()
                await asyncio.sleep(STATUS_EVERY_S)

        def __del__(self) -> None:
            with contextlib.suppress(Exception):
                self._beat.cancel()
                self.status_file.unlink()
                self.gen.close()

    return ModelServer.bind(args)  # type: ignore[attr-defined]  # added by @serve.deployment
