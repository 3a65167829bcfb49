"""`pstar bench serve`: the served models' speed through our endpoint, against
`transformers` `generate` in one process.

A `pstar serve` (local Ray head, Ray Serve) on a scratch data dir holding the base model;
`adapters` LoRA fine-tunes of it are made without training (random adapters, their job
rows written into the service's store, `benchmarks.models_made`). Three workloads, each
at every concurrency (streams started together, every stream a different prompt, greedy,
`max_tokens` each):
- `base`: the base model;
- `lora_1`: one adapter, on the base's deployment;
- `lora_8`: `adapters` adapters round robin over the streams, on the same deployment
  (each decode step then applies several adapters, one per row).
The reference is `generate` on the same base in this process: a batch of `c` prompts
(left-padded) for `c` streams. Rounds interleave every case (A B C ref A B C ref ...)
and medians are reported.

Measured per stream: time to first token (request sent to first content chunk, over
HTTP through the API and Serve's proxy) and completion tokens (usage); per round: all
streams' tokens over the round's wall time (tokens/s). `generate`'s time to first token
is a batch's prefill plus one token (`max_new_tokens=1`).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish, load_avg, machine, median
from pstar_core.hf import load_causal_lm

TOPICS = [
    "a lighthouse keeper", "a lost map", "the first snow", "a clockmaker", "a river town",
    "a quiet library", "an old violin", "a desert night", "a paper boat", "a mountain pass",
    "a market at dawn", "a broken compass", "a summer storm", "a garden wall", "a night train",
    "a small bakery",
]  # fmt: skip
TOKEN = "tok-bench-serve-0123456789"


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def one_round(client: Any, models: list[str], max_tokens: int) -> dict[str, Any]:
    """`len(models)` streams started together; their times to first token and the round's
    tokens per second."""
    n = len(models)
    ttft: list[float] = [float("nan")] * n
    tokens = [0] * n
    errors: list[str] = []
    start = threading.Barrier(n + 1)
    msgs = prompts(n)

    def stream(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        try:
            chunks = client.chat.completions.create(
                model=models[i],
                messages=msgs[i],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for c in chunks:
                first = ttft[i] != ttft[i]  # still NaN
                if first and c.choices and c.choices[0].delta.content:
                    ttft[i] = time.perf_counter() - t0
                if c.usage:
                    tokens[i] = c.usage.completion_tokens
        except Exception as e:  # reported, not raised: one bad stream shows in the table
            errors.append(f"{models[i]}: {e}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"ttft_s": ttft, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall,
            "errors": errors}  # fmt: skip


class Reference:
    """`generate` on the base model in this process, batched like `c` streams."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        from service.data.datasets import ensure_chat_template

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        ensure_chat_template(self.tok)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = load_causal_lm(model_dir, dtype=torch.float32).eval()

    def one_round(self, c: int, max_tokens: int) -> dict[str, Any]:
        import torch

        texts = [
            self.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in prompts(c)
        ]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(**enc, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self.model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
            wall = time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1] :]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        # tokens up to each row's first end-of-turn (what a stream would have returned)
        tokens = 0
        for row in new.tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            tokens += cut
        return {"ttft_s": [ttft] * c, "tokens": tokens, "tokens_per_s": tokens / wall,
                "errors": []}  # fmt: skip


def run(
    model_dir: Path,
    *,
    concurrency: tuple[int, ...] = (1, 4, 16),
    max_tokens: int = 32,
    rounds: int = 3,
    adapters: int = 8,
    json_out: bool = False,
) -> dict[str, Any]:
    import openai

    from benchmarks.models_made import lora_model
    from benchmarks.serve_process import ServeProcess
    from service.control.local_ray import free_port
    from service.store import Store

    console = Console()
    load_before = load_avg()
    data_dir = Path(tempfile.mkdtemp(prefix="pstar-bench-serve-"))
    base = model_dir.name
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / base).symlink_to(model_dir.resolve())
    env = {
        "PSTAR_SERVE_PORT": str(free_port()),
        "PSTAR_SERVE_IDLE_S": "3600",
        "PSTAR_SERVE_MAX_ADAPTERS": str(max(adapters, 1)),
        "PSTAR_MAX_CONCURRENT_GENERATIONS_PER_TENANT": str(max(concurrency) + 1),
    }
    serve = ServeProcess(data_dir, f"bench:{TOKEN}", env)
    cases: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        started_s = serve.start()
        store = Store(f"sqlite:///{data_dir / 'store.db'}")
        made = [
            lora_model(store, data_dir, base, "bench", seed=i + 1, checkpoint=False).model
            for i in range(adapters)
        ]
        store.close()
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key=TOKEN, max_retries=0,
                               timeout=600)  # fmt: skip
        t0 = time.perf_counter()
        one_round(client, [base], 2)  # deploys the base's application
        first_s = time.perf_counter() - t0
        one_round(client, made, 2)  # loads every adapter once
        workloads = {
            "base": lambda c: [base] * c,
            "lora_1": lambda c: [made[0]] * c,
            f"lora_{adapters}": lambda c: [made[i % adapters] for i in range(c)],
        }
        ref = Reference(model_dir)
        for _ in range(rounds):
            for c in concurrency:
                for name, pick in workloads.items():
                    cases.setdefault((name, c), []).append(one_round(client, pick(c), max_tokens))
                cases.setdefault(("generate", c), []).append(ref.one_round(c, max_tokens))
    finally:
        serve.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    rows = []
    for (name, c), rs in cases.items():
        ttfts = [t for r in rs for t in r["ttft_s"] if t == t]
        rows.append(
            {
                "workload": name,
                "streams": c,
                "ttft_p50_ms": round(1000 * median(ttfts), 1),
                "ttft_p90_ms": round(1000 * _quantile(ttfts, 0.9), 1),
                "tokens_per_s": round(median([r["tokens_per_s"] for r in rs]), 1),
                "tokens": int(median([r["tokens"] for r in rs])),
                "errors": sum(len(r["errors"]) for r in rs),
            }
        )
    many = f"lora_{adapters}"
    top = max(concurrency)
    ratio = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for a, b in zip(cases[(many, top)], cases[("lora_1", top)], strict=True)
    ]
    by = {(r["workload"], r["streams"]): r for r in rows}
    table = Table(
        title=f"serving {base}: {rounds} interleaved rounds, {max_tokens} tokens a stream"
    )
    for col in (
        "workload",
        "streams",
        "ttft p50 ms",
        "ttft p90 ms",
        "tokens/s",
        "tokens",
        "errors",
    ):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    console.print(table)
    console.print(
        f"pstar serve ready in {started_s:.1f} s; the base's first answer (deploying it) "
        f"{first_s:.1f} s; {many} vs lora_1 at {top} streams, per round: "
        + ", ".join(f"{x:.2f}" for x in ratio)
    )
    result = {
        "bench": "serve",
        "model": base,
        **machine("fp32"),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "cases": rows,
        "first_answer_s": round(first_s, 2),
        "ttft_p50_ms": by[("base", min(concurrency))]["ttft_p50_ms"],
        "tokens_per_s_16": by[("base", top)]["tokens_per_s"],
        "generate_tokens_per_s_16": by[("generate", top)]["tokens_per_s"],
        "adapters_8_vs_1": round(statistics.median(ratio), 3),
        "errors": sum(r["errors"] for r in rows),
    }
    return finish(console, result, load_before, load_avg(), json_out)


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    with contextlib.suppress(statistics.StatisticsError):
        return statistics.quantiles(xs, n=10)[int(q * 10) - 1] if len(xs) > 1 else xs[0]
    return xs[0]
