"""`pstar bench adam`: the engine's two host AdamW kernels, per chunk dtype and thread count.

The engine runs a chunk's AdamW on the host with one of two kernels, whichever is faster
on the CPU (`pstar_core.kernels.adam`, [Note: which host kernel]): ours (``cpp``) or
torch's fused AdamW as the engine calls it (``fused``: the compute-dtype gradient
converted to fp32 first, the new params cast back after). Both are timed here through the
engine's own entry point, ``adamw_``, with the backend forced by ``PSTAR_ADAM_BACKEND``,
on a chunk laid out as the engine lays it out: fp32 master and moments, the gradient read
from and the new param written into one slot of the chunk dtype (bf16 or fp32; fp16 too
when asked for), segments of 1-4M elements like the tensors of a real chunk. Beside them,
``torch.optim.AdamW(fused=True)`` on a plain fp32 parameter of the same size is the
reference. Each variant runs at each thread count (``torch.set_num_threads`` around it).

Rounds are interleaved (every variant at every thread count once per round, the order
reversed every other round) after one warm-up round, so the drift of a shared machine hits
all alike; medians are reported, with which kernel ``kernel_backend`` picks by default here
and the ratio cpp ÷ fused per chunk dtype and thread count.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.report import bench_dtype, finish, load_avg, machine, median, torch_dtype
from pstar_core.kernels.adam import AdamSegment, adamw_, kernel_backend

__all__ = ["run"]

# Elements per second only: a GB/s figure would rest on nominal bytes per element, and a
# backend's temporaries (or any cache effect) would make it a guess, not a measurement.
_BETAS = (0.9, 0.999)
_EPS = 1e-8
_LR = 1e-4
_WD = 0.01
_ENV = "PSTAR_ADAM_BACKEND"
BACKENDS = ("cpp", "fused")
TORCH_REF = "torch_adamw_fused"  # torch.optim.AdamW(fused=True) on a plain fp32 param


def _segments(numel: int, seed: int = 0) -> list[tuple[int, int]]:
    """Cover [0, numel) with consecutive spans of 1-4M elements (deterministic)."""
    rng = random.Random(seed)
    spans: list[tuple[int, int]] = []
    offset = 0
    while offset < numel:
        count = min(rng.randint(1 << 20, 4 << 20), numel - offset)
        spans.append((offset, count))
        offset += count
    return spans


@contextlib.contextmanager
def _forced(backend: str | None) -> Iterator[None]:
    """`PSTAR_ADAM_BACKEND=backend` for the block (None: as the user had it)."""
    saved = os.environ.get(_ENV)
    if backend is not None:
        os.environ[_ENV] = backend
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = saved


def _cpp_available() -> bool:
    with _forced("cpp"):
        try:
            kernel_backend(torch.float32)  # builds the extension (untimed) or raises
        except RuntimeError:
            return False
    return True


def parse_threads(values: Sequence[str] | None) -> list[int]:
    """Thread counts from repeated and/or comma-separated values; default 1 and torch's."""
    if not values:
        return sorted({1, torch.get_num_threads()})
    counts = {int(v) for item in values for v in str(item).split(",") if v.strip()}
    if not counts or min(counts) < 1:
        raise ValueError(f"thread counts must be >= 1, got {list(values)}")
    return sorted(counts)


def run(
    numel: int = 100_000_000,
    repeats: int = 7,
    threads: Sequence[str] | Sequence[int] | None = None,
    dtype: str = "auto",
    json_out: bool = False,
) -> dict[str, Any]:
    """Time the engine's host AdamW kernels per chunk dtype and thread count; print a
    table, return a dict (last printed as one JSON line with `json_out`).

    `dtype` is the engine's compute dtype (auto: what it picks here): its chunks are the
    headline; bf16 and fp32 chunks are measured whatever it is (fp16 too if it is fp16).
    Buffers are shared by all variants (~24 bytes per element, 2.4 GB at 100M); values
    drift with every step but stay finite and normal, which is all the timing needs.
    """
    if numel < 1 or repeats < 1:
        raise ValueError("need numel >= 1 and repeats >= 1")
    compute = bench_dtype(dtype)
    counts = parse_threads([str(t) for t in threads] if threads else None)
    chunk_dtypes = ["bf16", "fp32"] + (["fp16"] if compute == "fp16" else [])
    saved_threads = torch.get_num_threads()
    forced = os.environ.get(_ENV)

    # which kernel the engine takes here by default, per chunk dtype and thread count
    # (may build and measure once per CPU type, as a job would: not timed)
    default: dict[str, dict[str, str]] = {d: {} for d in chunk_dtypes}
    try:
        for n in counts:
            torch.set_num_threads(n)
            for d in chunk_dtypes:
                default[d][str(n)] = kernel_backend(torch_dtype(d))
    finally:
        torch.set_num_threads(saved_threads)
    backends = list(BACKENDS) if _cpp_available() else ["fused"]

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    exp_avg = torch.zeros(numel)
    exp_avg_sq = torch.zeros(numel)
    grad32 = torch.randn(numel, generator=gen)
    grads = {d: grad32 if d == "fp32" else grad32.to(torch_dtype(d)) for d in chunk_dtypes}
    slots = {d: torch.empty_like(g) for d, g in grads.items()}
    spans = _segments(numel)
    step = 0

    def engine_call(chunk: str, backend: str) -> Callable[[], float]:
        def timed() -> float:
            nonlocal step
            step += 1
            segs = [AdamSegment(o, c, step, _LR, _WD) for o, c in spans]
            slot = slots[chunk]
            slot.copy_(grads[chunk])  # the gradient lands in the param slot, as in backward
            with _forced(backend):
                start = time.perf_counter()
                adamw_(
                    master, exp_avg, exp_avg_sq, slot, slot, segs,
                    beta1=_BETAS[0], beta2=_BETAS[1], eps=_EPS,
                )  # fmt: skip
                return time.perf_counter() - start

        return timed

    def torch_reference() -> Callable[[], float]:
        p = torch.nn.Parameter(master)  # shares master's storage
        p.grad = grad32
        opt = torch.optim.AdamW([p], lr=_LR, betas=_BETAS, eps=_EPS, weight_decay=_WD, fused=True)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

        def timed() -> float:
            start = time.perf_counter()
            opt.step()
            return time.perf_counter() - start

        return timed

    variants: dict[tuple[str, str], Callable[[], float]] = {
        (d, b): engine_call(d, b) for d in chunk_dtypes for b in backends
    }
    variants[("fp32", TORCH_REF)] = torch_reference()
    keys = list(variants)
    times: dict[tuple[str, str, int], list[float]] = {
        (d, b, n): [] for d, b in keys for n in counts
    }
    before = load_avg()
    try:
        for i in range(repeats + 1):  # round 0 warms up (first touch, lazy init, thread pools)
            for n in counts if i % 2 == 0 else counts[::-1]:
                torch.set_num_threads(n)
                for key in keys if i % 2 == 0 else keys[::-1]:
                    gc.collect()  # a backend's temporaries are not billed to the next one
                    dt = variants[key]()
                    if i:
                        times[(*key, n)].append(dt)
    finally:
        torch.set_num_threads(saved_threads)
    after = load_avg()

    rate = {k: numel / median(ts) for k, ts in times.items()}
    per_dtype = {
        d: {str(n): {b: rate[(d, b, n)] for b in backends} for n in counts} for d in chunk_dtypes
    }
    ratio = (
        {
            d: {str(n): rate[(d, "cpp", n)] / rate[(d, "fused", n)] for n in counts}
            for d in chunk_dtypes
        }
        if "cpp" in backends
        else {}
    )
    top, one = str(counts[-1]), str(counts[0])
    result: dict[str, Any] = {
        "numel": numel,
        "repeats": repeats,
        "segments": len(spans),
        "threads": counts,
        "chunk_dtypes": chunk_dtypes,
        "backends_run": backends,
        "elems_per_s": per_dtype,  # chunk dtype -> threads -> backend -> elements/s
        "torch_adamw_fused_elems_per_s": {str(n): rate[("fp32", TORCH_REF, n)] for n in counts},
        "ratio_cpp_vs_fused": ratio,  # chunk dtype -> threads -> cpp ÷ fused
        "default_backend": default,  # chunk dtype -> threads -> what the engine takes here
        "forced_by_env": forced,
        # elements/s at the most threads ÷ at the fewest, per variant
        "thread_scaling": {
            f"{d}/{b}": rate[(d, b, counts[-1])] / rate[(d, b, counts[0])] for d, b in keys
        },
        "times_s": {f"{d}/{b}/{n}": ts for (d, b, n), ts in times.items()},
        **machine(compute),
        "load_avg": {"before": before, "after": after},
    }

    console = Console(width=max(Console().width, 130))
    table = Table(
        title=f"host AdamW, {numel / 1e6:g}M elements in {len(spans)} segments, CPU "
        f"{result['cpu_capability']}, the engine computes in {compute} here; median of "
        f"{repeats} interleaved rounds"
    )
    table.add_column("chunk")
    table.add_column("kernel")
    for n in counts:
        table.add_column(f"{n} thr G elem/s", justify="right")
        table.add_column(f"{n} thr ÷ fused", justify="right")
    table.add_column("default at", justify="right")
    labels = {"cpp": "cpp (ours)", "fused": "fused (torch's)", TORCH_REF: "torch AdamW fused"}
    for d, b in keys:
        cells = []
        for n in counts:
            cells.append(f"{rate[(d, b, n)] / 1e9:.3f}")
            cells.append(f"{rate[(d, b, n)] / rate[(d, 'fused', n)]:.2f}x")
        picked = [str(n) for n in counts if b == default.get(d, {}).get(str(n))]
        chunk = (
            f"{d} (engine)"
            if d == compute and b != TORCH_REF
            else f"{d} param"
            if b == TORCH_REF
            else d
        )
        table.add_row(chunk, labels[b], *cells, f"{', '.join(picked)} thr" if picked else "-")
    console.print(table)
    note = f"threads {', '.join(map(str, counts))}; "
    if forced:
        note += f"{_ENV}={forced} forces the default; "
    if "cpp" not in backends:
        note += "our C++ kernel could not be built here: fused only; "
    if ratio:
        note += f"cpp ÷ fused for {compute} chunks at {top} thr {ratio[compute][top]:.2f}x "
        note += f"(at {one} thr {ratio[compute][one]:.2f}x); "
    return finish(console, result, before, after, json_out, note)
