"""One request run to its end on a generator and collected (the tests and tools that ask
a generator directly, without a server)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.serving.generation import (
    Done,
    Finish,
    Generator,
    PromptLogprobs,
    Request,
    SamplingParams,
    Token,
)


@dataclass
class Collected:
    """A whole completion (the non-streaming path and tests)."""

    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    logprobs: dict[int, tuple[float, ...]] = field(default_factory=dict)
    prompt_logprobs: tuple[float, ...] | None = None
    usage: Done | None = None
    error: str | None = None


def complete(
    gen: Generator,
    prompt_ids: list[int],
    params: SamplingParams,
    adapter: str | None = None,
    adapter_path: Path | None = None,
    tenant: str | None = None,
) -> Collected:
    """Run one request to its end on `gen` and collect it (blocking)."""
    got = Collected()
    done = threading.Event()

    def emit(ev: Any) -> None:
        if isinstance(ev, Token):
            got.texts[ev.index] = got.texts.get(ev.index, "") + ev.text
        elif isinstance(ev, Finish):
            got.reasons[ev.index] = ev.reason
            got.tokens[ev.index] = ev.tokens
            got.logprobs[ev.index] = ev.logprobs
        elif isinstance(ev, PromptLogprobs):
            got.prompt_logprobs = ev.values
        elif isinstance(ev, Done):
            got.usage = ev
            done.set()
        else:
            got.error = str(ev)
            done.set()

    gen.submit(Request(prompt_ids, params, emit, adapter, adapter_path, tenant))
    done.wait()
    return got
