"""`pstar bench prefix`: what keeping prompts' keys and values across requests (a
replica's prefix cache, `service.serving.kv`) saves, on a real model in this process.

Two generators on the same model directory, one keeping prompts (the default budget) and
one keeping none, asked the same requests in interleaved rounds, greedy:
- `system`: `questions` chats that share one long system prompt (numbered house rules,
  about `system_tokens` tokens), each a different question, one after another; the first
  of a round fills the cache, so the figures are over the rest;
- `together`: the same many chats (each question asked differently) sent at once after
  those, prefilled together: with the cache, each row reuses the system prompt;
- `turns`: one conversation of `turns` turns, each prompt the whole transcript so far
  (the model's own answers sent back, as a chat client or an agent loop does).
Measured per request: the time to its first token (`max_tokens` 1 for `system`, the
turn's whole answer for `turns`, whose first token is timed) and the prompt tokens
reused. Each case's answers from the two generators are compared token for token.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish, load_avg, machine, median

QUESTIONS = [
    "What should I pack for a rainy weekend?", "How do I water a fern?",
    "Which road is shortest to the harbor?", "When does the library open?",
    "Can I bring a dog to the market?", "What is a good first bicycle?",
    "How long does bread take to rise?", "Where do I leave a parcel?",
    "What is the quietest room?", "Who fixes a broken window?",
    "How cold does the lake get?", "Is the mountain trail open?",
    "What should a guest bring?", "Which lamp is best for reading?",
    "How do I fold a paper boat?", "When is the next train?",
]  # fmt: skip


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """Numbered house rules, about `tokens` tokens long."""
    rules, k = [], 0
    while len(tokenizer(" ".join(rules))["input_ids"]) < tokens:
        k += 1
        rules.append(
            f"Rule {k}: answer the guest's question about room {k} politely, name the floor "
            f"({k % 7}), and never promise a time you cannot keep."
        )
    return "You are the concierge of a small hotel. " + " ".join(rules)


def first_token(gen: Any, ids: list[int], max_tokens: int) -> tuple[float, Any]:
    """Seconds from submitting to the first token, and the whole answer."""
    return first_tokens(gen, [ids], max_tokens)[0]


def first_tokens(gen: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, Any]]:
    """`prompts` submitted at once: each one's seconds to its first token and its answer."""
    return [wait() for wait in [_submit(gen, ids, max_tokens) for ids in prompts]]


def _submit(gen: Any, ids: list[int], max_tokens: int) -> Any:
    from service.serving.generation import (
        Done,
        Finish,
        Request,
        SamplingParams,
        Token,
    )

    got: dict[str, Any] = {"tokens": (), "cached": 0}
    first = threading.Event()
    done = threading.Event()
    seen = [0.0]

    def emit(ev: Any) -> None:
        if isinstance(ev, (Token, Finish)) and not first.is_set():
            seen[0] = time.perf_counter()
            first.set()
        if isinstance(ev, Finish):
            got["tokens"] = ev.tokens
        elif isinstance(ev, Done):
            got["cached"] = ev.cached_tokens
            done.set()
        elif not isinstance(ev, (Token, Finish)):
            got["error"] = str(ev)
            done.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    gen.submit(Request(ids, params, emit))

    def wait() -> tuple[float, Any]:
        done.wait()
        if "error" in got:
            raise RuntimeError(got["error"])
        return seen[0] - t0, got

    return wait


def run(
    model_dir: Path,
    *,
    system_tokens: int = 1024,
    questions: int = 8,
    turns: int = 6,
    answer_tokens: int = 24,
    rounds: int = 3,
    json_out: bool = False,
) -> dict[str, Any]:
    from service.serving.generation import Generator

    console = Console()
    load_before = load_avg()
    gens = {"kept": Generator(model_dir), "none": Generator(model_dir, prefix_cache_bytes=0)}
    tok = gens["kept"].tokenizer
    system = system_prompt(tok, system_tokens)
    times: dict[tuple[str, str], list[float]] = {}
    cached: dict[tuple[str, str], list[int]] = {}
    answers: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    same = {"system": 0, "together": 0, "turns": 0}
    asked = dict.fromkeys(same, 0)
    try:
        for _ in range(rounds):
            for name, gen in gens.items():
                gen.prefixes.forget(None)  # every round starts cold
                qs = QUESTIONS[:questions]
                for i, q in enumerate(qs):
                    msgs = [
                        {"role": "system", "content": system},
                        {"role": "user", "content": q},
                    ]
                    s, got = first_token(gen, gen.render(msgs), 1)
                    if i:  # the first fills the cache
                        times.setdefault(("system", name), []).append(s)
                        cached.setdefault(("system", name), []).append(got["cached"])
                    answers.setdefault(("system", name), []).append(got["tokens"])
                batch = [
                    gen.render(
                        [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"Briefly: {q}"},
                        ]
                    )
                    for q in qs
                ]
                for s, got in first_tokens(gen, batch, 1):
                    times.setdefault(("together", name), []).append(s)
                    cached.setdefault(("together", name), []).append(got["cached"])
                    answers.setdefault(("together", name), []).append(got["tokens"])
                msgs = [{"role": "system", "content": system}]
                for q in QUESTIONS[:turns]:
                    msgs.append({"role": "user", "content": q})
                    s, got = first_token(gen, gen.render(msgs), answer_tokens)
                    times.setdefault(("turns", name), []).append(s)
                    cached.setdefault(("turns", name), []).append(got["cached"])
                    answers.setdefault(("turns", name), []).append(got["tokens"])
                    msgs.append({"role": "assistant", "content": tok.decode(got["tokens"])})
        for case in same:
            pairs = zip(answers[(case, "kept")], answers[(case, "none")], strict=True)
            for a, b in pairs:
                asked[case] += 1
                same[case] += a == b
    finally:
        for g in gens.values():
            g.close()

    rows = []
    for (case, name), ts in sorted(times.items()):
        rows.append(
            {
                "case": case,
                "cache": name,
                "ttft_p50_ms": round(1000 * median(ts), 1),
                "cached_tokens_p50": int(median(cached[(case, name)])),
            }
        )
    by = {(r["case"], r["cache"]): r for r in rows}
    ratio = {
        c: round(by[(c, "kept")]["ttft_p50_ms"] / by[(c, "none")]["ttft_p50_ms"], 3) for c in same
    }
    table = Table(
        title=f"prefix cache on {model_dir.name}: {rounds} interleaved rounds, system prompt "
        f"~{system_tokens} tokens, {questions} questions, {turns} turns of {answer_tokens} tokens"
    )
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("case", "cache") else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    console.print(
        "same greedy tokens with and without: "
        + ", ".join(f"{c} {same[c]}/{asked[c]}" for c in same)
    )
    dtype = str(next(gens["kept"].model.parameters()).dtype).removeprefix("torch.")
    result = {
        "bench": "prefix",
        "model": model_dir.name,
        **machine(dtype),
        "rounds": rounds,
        "cases": rows,
        "ttft_ratio_system": ratio["system"],
        "ttft_ratio_together": ratio["together"],
        "ttft_ratio_turns": ratio["turns"],
        "same_tokens": {c: f"{same[c]}/{asked[c]}" for c in same},
    }
    return finish(console, result, load_before, load_avg(), json_out)
