"""`pstar bench load DIR`: peak host memory and time of loading a pretrained HF directory.

Each loader runs in a fresh subprocess so peaks do not mix: ours (stream safetensors into
chunks) and transformers' `from_pretrained`, both in one dtype (`--dtype`, default auto:
what the engine picks on this CPU). Reported per loader: time, the process's peak RSS
above its RSS right before loading, the dtype it holds the weights in, and for ours the
part of that peak beyond the chunks themselves (what streaming costs on top of the model
data it must hold).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import bench_dtype, finish, last_json, load_avg, machine

_CHILD = r"""
import json, resource, sys, time
import psutil, torch
import pstar_core, transformers
path, which, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
# Import what loading will need first, so import time and memory count for neither side.
_cfg = transformers.AutoConfig.from_pretrained(path)
transformers.AutoModelForCausalLM._model_mapping[type(_cfg)]
proc = psutil.Process()
before = proc.memory_info().rss
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
names = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
if which == "engine":
    engine = pstar_core.initialize(path, {"dtype": dtype})
    held = engine.stats()["chunk_bytes"]
    held_dtype = engine.stats()["precision"]["dtype"]
else:
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=tdt)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held_dtype = "/".join(sorted({names.get(p.dtype, str(p.dtype)) for p in model.parameters()}))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss_before": before, "peak_before": peak_before,
                  "peak": peak, "held_bytes": held, "dtype": held_dtype}))
"""


def _child(path: Path, which: str, dtype: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), which, dtype],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    got = last_json(out.stdout)
    if got is None:
        raise RuntimeError(f"the {which} loader printed no result: {out.stdout[-500:]}")
    return got


def run(path: Path, dtype: str = "auto", repeats: int = 2, json_out: bool = False) -> dict:
    dtype = bench_dtype(dtype)
    before = load_avg()
    files = list(path.glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    rows: dict[str, list[dict[str, Any]]] = {"engine": [], "transformers": []}
    for _ in range(repeats):  # interleaved: engine, transformers, engine, ...
        for which in rows:
            rows[which].append(_child(path, which, dtype))
    after = load_avg()
    result: dict[str, Any] = {
        "model_dir": str(path),
        "dtype": dtype,
        "file_bytes": file_bytes,
        **machine(dtype),
        "load_avg": {"before": before, "after": after},
    }
    table = Table(
        title=f"loading {path.name} ({file_bytes / 2**20:.0f} MiB of safetensors) in {dtype}, "
        f"CPU {result['cpu_capability']}, median of {repeats}"
    )
    cols = ("loader", "median s", "peak RSS above start (MiB)", "held (MiB)", "held in", "beyond")
    for col in cols:
        table.add_column(col, justify="right" if col != "loader" else "left")
    for which, runs in rows.items():
        runs.sort(key=lambda r: r["seconds"])
        mid = runs[len(runs) // 2]
        grow = max(0, mid["peak"] - max(mid["rss_before"], 0))
        beyond = grow - mid["held_bytes"]
        result[which] = {
            "seconds": mid["seconds"],
            "peak_rss_growth_bytes": grow,
            "held_bytes": mid["held_bytes"],
            "beyond_held_bytes": beyond,
            "held_dtype": mid["dtype"],
        }
        table.add_row(
            which,
            f"{mid['seconds']:.2f}",
            f"{grow / 2**20:.0f}",
            f"{mid['held_bytes'] / 2**20:.0f}",
            mid["dtype"],
            f"{beyond / 2**20:.0f} MiB",
        )
    console = Console()
    console.print(table)
    console.print(
        "peak RSS is the process peak (ru_maxrss) minus its RSS just before loading; "
        "held = chunks (engine) or parameters (transformers); beyond = peak RSS above start "
        "- held"
    )
    return finish(console, result, before, after, json_out)
