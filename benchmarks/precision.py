"""`pstar bench precision`: what `dtype: auto` costs against the best fixed choice here.

The same zoo GPT (same initial weights, same token batches) is trained by three engines
that differ only in `dtype`: bf16, fp32 and auto. Steps are interleaved one whole step at
a time with the order alternating between rounds (A B C, C B A, ...), so the machine's
drift hits all alike; reported are medians of per-step times, what auto resolved to (and
why), the matmul probe the decision rests on, and last `auto_vs_best`: auto's median over
the faster fixed choice's (goal <= 1.05). A figure holds for this machine's CPU only: the
JSON names its capability and the thread count.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import finish, load_avg, machine, median
from pstar_core.models import build, get_config, num_params

__all__ = ["run"]

CHOICES = ("bf16", "fp32", "auto")


def run(
    model: str = "gpt-small",
    batch: int = 2,
    seq: int = 128,
    steps: int = 3,
    warmup: int = 1,
    json_out: bool = False,
) -> dict[str, Any]:
    console = Console()
    torch.manual_seed(0)
    state = build(model, seq_len=seq).state_dict()
    engines = {}
    for name in CHOICES:
        cfg = {"dtype": name, "optimizer": {"lr": 1e-4}}
        engine = pstar_core.initialize(lambda: build(model, seq_len=seq), cfg)
        engine.load_state_dict(state)
        engines[name] = engine
    cfg = get_config(model)
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(warmup + steps)]
    times: dict[str, list[float]] = {n: [] for n in CHOICES}
    losses: dict[str, list[float]] = {n: [] for n in CHOICES}
    before = load_avg()
    for i, x in enumerate(data):
        order = CHOICES if i % 2 == 0 else CHOICES[::-1]
        for name in order:
            engine = engines[name]
            gc.collect()
            t0 = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
                losses[name].append(float(loss.detach()))
    after = load_avg()
    auto = engines["auto"].stats()["precision"]
    med = {n: median(ts) for n, ts in times.items()}
    best = min(med["bf16"], med["fp32"])
    result: dict[str, Any] = {
        "model": model,
        "params": num_params(cfg),
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "median_step_s": med,
        "times_s": times,
        "auto_picked": auto["dtype"],
        "auto_reason": auto["reason"],
        "probe_gflops": auto["probe_gflops"],
        **machine(auto["dtype"]),
        "load_avg": {"before": before, "after": after},
        "auto_vs_best": med["auto"] / best,
    }
    for engine in engines.values():
        engine.close()
    table = Table(
        title=f"{model} ({result['params'] / 1e6:.1f}M params), batch {batch} x seq {seq}, "
        f"CPU {result['cpu_capability']}, {result['torch_threads']} threads, "
        f"median of {steps} interleaved steps"
    )
    for col in ("dtype", "s/step", "tokens/s", "vs best"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for name in CHOICES:
        label = f"auto -> {auto['dtype']}" if name == "auto" else name
        table.add_row(
            label,
            f"{med[name]:.3f}",
            f"{batch * seq / med[name]:.0f}",
            f"{med[name] / best:.2f}x",
        )
    console.print(table)
    console.print(f"auto: {auto['reason']}")
    return finish(console, result, before, after, json_out)
