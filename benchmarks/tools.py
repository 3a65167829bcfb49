"""Function calling, measured: `pstar bench tools`.

A small function-calling set built on this machine from WordNet (Debian's `wordnet-base`):
two tools, `lookup_definition(word)` and `find_synonyms(word)`, and for each word one of
two asks, "What does 'X' mean?" or "Give me a word that means the same as 'X'.", whose
answer is the one call with `{"word": "X"}`. Lines are OpenAI's function-calling
fine-tuning format (`tools` beside the messages, the assistant's `tool_calls`); training
and held-out words are disjoint.

It runs as a user runs it: `pstar serve` with its local Ray, the file uploaded, a LoRA
job on SmolLM2-135M-Instruct (whose chat template knows no tools: the documented
fallback format renders them, in training and in serving alike), then the held-out asks
sent to `/v1/chat/completions` with `tools` (`tool_choice: auto`, greedy) before
fine-tuning (the base model) and after (the fine-tuned one). A held-out ask is right when
the answer is exactly one call, to the right function, with arguments `{"word": "X"}`.
Reported: that accuracy before and after, the share with the right function name, the
share answered with any call, and the job's wall time.

    pstar bench tools --json
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish, load_avg, machine
from benchmarks.rft import MODEL, _wordnet_dir, synonym_prompts

__all__ = ["TOOLS", "lines", "run", "score"]

TOKEN = "sk-bench-tools"


def _tool(name: str, what: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": what,
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "description": "the word"}},
                "required": ["word"],
            },
        },
    }


TOOLS = [
    _tool("lookup_definition", "The dictionary definition of a word"),
    _tool("find_synonyms", "Words that mean the same as a word"),
]
ASKS = {
    "lookup_definition": "What does '{word}' mean?",
    "find_synonyms": "Give me a word that means the same as '{word}'.",
}


def asks(words: list[str], seed: int) -> list[tuple[str, str, str]]:
    """(word, the ask, the function that answers it), each word asked one way."""
    rng = random.Random(seed)
    out = []
    for w in words:
        fn = rng.choice(sorted(ASKS))
        out.append((w, ASKS[fn].format(word=w), fn))
    return out


def lines(items: list[tuple[str, str, str]]) -> bytes:
    """OpenAI's function-calling fine-tuning lines: the ask, the one call that answers it."""
    rows = []
    for k, (word, ask, fn) in enumerate(items):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": fn, "arguments": json.dumps({"word": word})},
        }
        msgs = [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
        rows.append(json.dumps({"messages": msgs, "tools": TOOLS, "parallel_tool_calls": False}))
    return ("\n".join(rows) + "\n").encode()


def score(message: dict[str, Any], word: str, fn: str) -> dict[str, bool]:
    """What an answer got right: any call, the function's name, the whole call."""
    calls = message.get("tool_calls") or []
    named = len(calls) == 1 and calls[0]["function"]["name"] == fn
    try:
        args = json.loads(calls[0]["function"]["arguments"]) if named else None
    except ValueError:
        args = None
    return {"called": bool(calls), "named": named, "right": named and args == {"word": word}}


def _ask_all(http: Any, model: str, items: list[tuple[str, str, str]]) -> dict[str, float]:
    got = {"called": 0, "named": 0, "right": 0}
    for word, ask, fn in items:
        r = http.post(
            "/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": ask}],
                "tools": TOOLS,
                "tool_choice": "auto",
                "temperature": 0,
                "max_tokens": 48,
            },
        )
        r.raise_for_status()
        for k, v in score(r.json()["choices"][0]["message"], word, fn).items():
            got[k] += int(v)
    return {k: v / len(items) for k, v in got.items()}


def run(
    model_dir: Path,
    steps: int = 40,
    batch: int = 8,
    lr_multiplier: float = 3.0,
    train_words: int = 320,
    held_out: int = 40,
    dtype: str = "fp32",
    seed: int = 0,
    timeout_s: float = 3600.0,
    json_out: bool = False,
) -> dict[str, Any]:
    from benchmarks.serve_process import ServedModel

    console = Console(stderr=json_out)
    load_before = load_avg()
    words = [w for w, _ in synonym_prompts(_wordnet_dir())]
    random.Random(seed).shuffle(words)
    if len(words) < train_words + held_out:
        raise ValueError(f"WordNet gives {len(words)} words, fewer than asked for")
    train = asks(words[:train_words], seed)
    test = asks(words[train_words : train_words + held_out], seed + 1)
    with ServedModel(model_dir, MODEL, TOKEN, "pstar-tools-") as served:
        before = _ask_all(served.http, MODEL, test)
        hp = {"batch_size": batch, "n_epochs": 10, "max_steps": steps,
              "learning_rate_multiplier": lr_multiplier}  # fmt: skip
        body = {
            "model": MODEL,
            "training_file": served.upload("calls.jsonl", lines(train)),
            "seed": seed,
            "suffix": "tools",
            "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "hyperparameters": hp}},
            "resources": {"num_workers": 1},
            "engine": {"dtype": dtype},
            "checkpoint_every": steps,
        }
        job, wall = served.run_job(body, timeout_s)
        after = _ask_all(served.http, job["fine_tuned_model"], test)
    result: dict[str, Any] = {
        "bench": "tools",
        "model": MODEL,
        "steps": steps,
        "batch": batch,
        "train_lines": train_words,
        "held_out": held_out,
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()},
        "job_wall_s": round(wall, 1),
        **machine(dtype),
    }
    table = Table(title=f"Tool calls: {held_out} held-out asks, {MODEL}, LoRA {steps} steps")
    table.add_column("held-out share")
    table.add_column("base", justify="right")
    table.add_column("fine-tuned", justify="right")
    for k, what in (("right", "the right call"), ("named", "the right function"),
                    ("called", "any call")):  # fmt: skip
        table.add_row(what, f"{before[k]:.3f}", f"{after[k]:.3f}")
    console.print(table)
    return finish(console, result, load_before, load_avg(), json_out, f"job {wall:.0f} s; ")
