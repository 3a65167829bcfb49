"""Benchmark of the chunk AdamW kernel against torch's own AdamW implementations.

Owns ``run``: times ``pstar_core.kernels.adam.adamw_`` the way the engine runs it (bf16
grads read from, and bf16 params written back into, the same slot; fp32 master and
states; one segment per 1-4M elements like real tensors in a chunk), plus an fp32-grad
variant, against ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on a plain fp32
parameter of the same size. Runs are interleaved (A B C D A B C D ...) so that load from
other processes on a shared machine hits every variant alike; medians are reported.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from pstar_core.kernels.adam import AdamSegment, adamw_, kernel_backend

# Elements per second only: a GB/s figure would rest on nominal bytes per element, and
# foreach's temporaries (or any cache effect) would make it a guess, not a measurement.
_BETAS = (0.9, 0.999)
_EPS = 1e-8
_LR = 1e-4
_WD = 0.01


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


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(numel: int = 100_000_000, repeats: int = 7, json_out: bool = False) -> dict:
    """Measure elements/s of our kernel vs torch fused/foreach AdamW; print a table.

    All variants share one set of fp32 buffers (param, exp_avg, exp_avg_sq, fp32 grad)
    plus a bf16 grad/param slot, so peak memory is ~18 bytes per element (1.8 GB at 100M)
    instead of a full set per variant; the torch optimizers get those tensors injected as
    their state. Values drift with every step but stay finite and normal, which is all the
    timing needs.
    """
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    exp_avg = torch.zeros(numel)
    exp_avg_sq = torch.zeros(numel)
    grad32 = torch.randn(numel, generator=gen)
    grad16 = grad32.to(torch.bfloat16)
    spans = _segments(numel)
    step = 0

    def ours(grad: torch.Tensor) -> Callable[[], None]:
        def fn() -> None:
            nonlocal step
            step += 1
            segs = [AdamSegment(o, c, step, _LR, _WD) for o, c in spans]
            # grad and param_out are the same slot, as in the engine.
            adamw_(
                param, exp_avg, exp_avg_sq, grad, grad, segs,
                beta1=_BETAS[0], beta2=_BETAS[1], eps=_EPS,
            )  # fmt: skip

        return fn

    def torch_opt(**flags: bool) -> Callable[[], None]:
        p = torch.nn.Parameter(param)  # shares param's storage
        p.grad = grad32
        opt = torch.optim.AdamW([p], lr=_LR, betas=_BETAS, eps=_EPS, weight_decay=_WD, **flags)
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
        return opt.step

    variants: dict[str, Callable[[], None]] = {
        "ours_bf16": ours(grad16),
        "ours_fp32": ours(grad32),
        "torch_fused": torch_opt(fused=True),
        "torch_foreach": torch_opt(foreach=True),
    }
    backend = kernel_backend()  # builds the extension outside the timed region
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: first touch, lazy init
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            gc.collect()  # foreach leaves big temporaries behind; don't bill them to the next
            times[name].append(_time(fn))
    load_after = os.getloadavg()

    rate = {name: numel / statistics.median(ts) for name, ts in times.items()}
    result = {
        "numel": numel,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "backend": backend,
        "segments": len(spans),
        "ours_elems_per_s": rate["ours_bf16"],
        "ours_fp32_grad_elems_per_s": rate["ours_fp32"],
        "torch_fused_elems_per_s": rate["torch_fused"],
        "torch_foreach_elems_per_s": rate["torch_foreach"],
        "ratio_vs_torch_fused": rate["ours_bf16"] / rate["torch_fused"],
        "ratio_vs_torch_foreach": rate["ours_bf16"] / rate["torch_foreach"],
        "ratio_fp32_grad_vs_torch_fused": rate["ours_fp32"] / rate["torch_fused"],
        "load_avg": {"before": list(load_before), "after": list(load_after)},
        "times_s": times,
    }

    table = Table(
        title=f"AdamW step, {numel / 1e6:.0f}M elements, {result['threads']} threads, "
        f"backend={backend}, median of {repeats}"
    )
    table.add_column("variant")
    table.add_column("G elem/s", justify="right")
    table.add_column("min..max", justify="right")
    table.add_column("vs fused", justify="right")
    labels = {
        "ours_bf16": "pstar bf16 grad->param",
        "ours_fp32": "pstar fp32 grad->param",
        "torch_fused": "torch fused (fp32)",
        "torch_foreach": "torch foreach (fp32)",
    }
    for name, ts in times.items():
        table.add_row(
            labels[name],
            f"{rate[name] / 1e9:.3f}",
            f"{numel / max(ts) / 1e9:.2f}..{numel / min(ts) / 1e9:.2f}",
            f"{rate[name] / rate['torch_fused']:.2f}x",
        )
    console = Console()
    console.print(table)
    console.print(
        f"load avg (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/"
        f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/"
        f"{load_after[2]:.2f}; ratio vs fused {result['ratio_vs_torch_fused']:.2f}x, "
        f"vs foreach {result['ratio_vs_torch_foreach']:.2f}x"
    )
    if json_out:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return result
