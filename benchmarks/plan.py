"""`pstar bench plan`: the capacity planner against the paper and against this engine.

1. The paper's four model-scale configurations (YARD and SuperPod, 1 and 8 GPUs): the
   planner's largest model under this engine's rule and under the paper's capacity rule,
   next to the model the paper trained, and whether memory or the paper's throughput bar
   bounded it.
2. The paper's chunk-size table next to this engine's chunk-size search.
3. The forecast of an iteration (device and host peaks, bytes moved each way) against the
   engine's own figures, with CPU budgets standing in for the GPU and host tiers: the
   test's three models and three budget splits, and gpt-100m besides.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.plan_check import (
    CHECKED,
    PAPER_CASES,
    SPLITS,
    VALIDATION,
    calibration_error,
    check_split,
    chunk_table,
    paper_case,
)
from benchmarks.report import finish, load_avg

# gpt-100m: chunks of its embedding's size, three of them
BENCH_MODELS = (*VALIDATION, ("gpt-100m", 38597376))
_SHORT = {"device_peak_bytes": "device peak", "host_peak_bytes": "host peak"}
_SHORT |= {"host_to_device_bytes": "host->dev", "device_to_host_bytes": "dev->host"}


def run(models: tuple = BENCH_MODELS, json_out: bool = False) -> dict[str, Any]:
    console = Console()
    before = load_avg()

    t0 = time.perf_counter()
    cases = [paper_case(c) for c in PAPER_CASES]
    plan_s = time.perf_counter() - t0
    table = Table(
        title="the paper's model-scale results and the planner's (batch 8; memory, and the "
        "paper's TFLOPS bar with the GPU's stated figures)"
    )
    for col in ("case", "paper trained", "bounded by", "planner", "its TFLOPS (bar)",
                "paper's rule", "next: why"):  # fmt: skip
        table.add_column(col)
    for c in cases:
        tflops = f"{c['planner_tflops']:.0f}" if c["planner_tflops"] else "-"
        table.add_row(
            c["case"], c["paper"], c["bounded_by"], c["planner"],
            f"{tflops} ({c['min_tflops']:g}, {c['gpu']})", c["planner_paper_rule"],
            f"{c['next_model']}: {c['next_why']}" if c["next_model"] else "-",
        )  # fmt: skip
    console.print(table)

    chunks = chunk_table()
    table = Table(title="chunk sizes (M = 2^20 elements): the paper's and this engine's search")
    for col in ("model", "paper", "paper util", "ours", "ours util", "paper's size, ours"):
        table.add_column(col, justify="right")
    for r in chunks:
        paper_util = f"{r['paper_utilization']:.2%}" if r["paper_utilization"] else "-"
        table.add_row(
            r["model"], f"{r['paper_chunk_m']}M", paper_util, f"{r['chunk_m']:.0f}M",
            f"{r['utilization']:.2%}", f"{r['utilization_at_paper_size']:.2%}",
        )  # fmt: skip
    console.print(table)

    rows = [check_split(m, c, s) for m, c in models for s in SPLITS]
    table = Table(title="forecast vs engine, fp32 on CPU budgets (MiB; error)")
    for col in ("model", "split", *(_SHORT[k] for k in CHECKED)):
        table.add_column(col, justify="right")
    for r in rows:
        cells = [
            f"{r['predicted'][k] / 2**20:.1f} / {r['measured'][k] / 2**20:.1f} "
            f"({r['error'][k]:.1%})"
            for k in CHECKED
        ]
        table.add_row(r["model"], r["split"], *cells)
    console.print(table)
    cal = calibration_error()
    console.print(
        f"planned the four configurations in {plan_s:.1f} s; activation model vs the "
        f"shipped tracer peaks: median {cal['median']:.1%}, max {cal['max']:.1%} "
        f"over {cal['points']} points"
    )
    result = {
        "bench": "plan",
        "paper_cases": cases,
        "chunk_table": chunks,
        "forecast": rows,
        "plan_seconds": round(plan_s, 2),
        "calibration_error": cal,
        "compute_dtype": "fp32",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "paper_cases_within_one_step": all(c["within_one_step"] for c in cases),
        "paper_cases_within_one_step_strict": all(c["within_one_step_strict"] for c in cases),
        "max_prediction_error": max(r["max_error"] for r in rows),
    }
    return finish(console, result, before, load_avg(), json_out)
