"""`pstar bench overlap`: how much of the host<->device copy time the engine hides, per
phase, on the test suite's second device with a modeled link (issue 32's measure).

The fake device (`tests/fakedevice`, loaded from this checkout) computes on the real CPU
and, with a link set, makes every copy between host and device take latency + bytes ÷
bandwidth of wall time on a copy engine per direction ([Note: a modeled link] in
fakegpu.cpp): a copy issued ahead on a copy stream runs while the host computes, and the
host sleeps only for what is not done when it waits. So `exposed` is the copy time the
engine did not hide, measured, not estimated.

What runs: a zoo GPT (by default `gpt-small` with 8 layers and a 2048-token vocabulary,
so its chunks are not all one embedding: 9 chunks) in the dtype asked for, under two
device budgets from a probe run
(`benchmarks.doctor.budgets`; N: its peak non-model bytes; P: its param chunks):
- `params_evicted`: N + P/2, params leave the device in forward and backward, Adam on
  the host;
- `adam_split`: N + P + two chunks' optimizer states and Adam's temporary, Adam on the
  device for some chunks and on the host for the rest.
The link's bandwidth is set so one param chunk's copy takes about one layer's forward
compute (measured by the probe), unless `gbps` is given. Each budget trains `warmup`
steps, then `steps` steps with the link and as many without it, alternated; phases
(forward, backward, optimizer) are bounded by device synchronizations, and the link's
counts are read at each boundary. Then `steps` steps run back to back, as a training
loop runs them (one synchronization after the last, so a step's copies may run on into
the next: the parameters Adam updated go back to the device beside the next forward), in
blocks with the link and without, two each, alternated.

Reported per budget and phase: the copy time issued (engine time), the copy time exposed
(the host asleep waiting) and the hidden fraction 1 - exposed/issued; the step time with
and without the link, phase by phase (`link_slowdown_phases`: each phase waits for its
copies) and free-running. The last JSON line: `hidden_fraction_fwd_bwd` (goal >= 0.8),
`optimizer_over_max` (the optimizer phase with the link ÷ max(its copy time, the same
phase without the link); goal <= 1.2) and `link_slowdown` (the free-running step with ÷
without the link; goal <= 1.25), each the worse of the two budgets; and
`forecast_over_measured`: the planner's step time (`forecast.Rates`: the compute and
host-Adam rates this run measured without the link, the modeled link) over the measured
free-running step, the one farther from 1 (issue 32 asks for within 15%).

    pstar bench overlap --json
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.doctor import budgets
from benchmarks.report import bench_dtype, fake_device, finish, load_avg, machine, median

__all__ = ["run"]

PHASES = ("forward", "backward", "optimizer")
DIRECTIONS = ("host_to_device", "device_to_host")


def _link_totals(fake) -> tuple[float, float]:
    """(engine time issued, host time waited) over both directions so far."""
    stats = fake.link_stats()
    return (
        sum(stats[d]["busy_s"] for d in DIRECTIONS),
        sum(stats[d]["waited_s"] for d in DIRECTIONS),
    )


def _step(engine, x, fake, dev, beside: bool = False) -> dict[str, dict[str, float]]:
    """One training step, its phases bounded by synchronizations: per phase the wall
    time, the copy time issued and the copy time exposed. With `beside` the step is
    `backward_and_step` (host Adam beside backward); its optimizer phase starts where the
    engine's `step()` does, so it holds what Adam beside backward did not finish."""
    marks: list[tuple[float, float, float]] = []

    def mark() -> None:
        fake.synchronize(dev)
        issued, waited = _link_totals(fake)
        marks.append((time.perf_counter(), issued, waited))

    mark()
    loss = engine(input_ids=x, labels=x).loss
    mark()
    if beside:
        step = engine.step

        def marked_step(hyper=None):
            mark()
            return step(hyper)

        engine.step = marked_step  # what backward_and_step calls once backward is done
        try:
            engine.backward_and_step(loss)
        finally:
            del engine.step
    else:
        engine.backward(loss)
        mark()
        engine.step()
    mark()
    return {
        phase: {"wall_s": t1 - t0, "issued_s": i1 - i0, "exposed_s": w1 - w0}
        for phase, (t0, i0, w0), (t1, i1, w1) in zip(PHASES, marks[:-1], marks[1:], strict=True)
    }


def _free_running(engine, data, fake, dev, gbps, steps, beside) -> tuple[float, float]:
    """Seconds per step of `steps` steps run back to back, as a training loop runs them
    (one synchronization after the last: a step's copies may run on into the next), in
    blocks with the link and without, two each, alternated; the medians (with, without)."""
    per: dict[bool, list[float]] = {True: [], False: []}
    for block in range(4):
        linked = block % 2 == 0
        fake.synchronize(dev)
        fake.set_link(gbps if linked else 0.0)
        t0 = time.perf_counter()
        for x in data[:steps]:
            loss = engine(input_ids=x, labels=x).loss
            if beside:
                engine.backward_and_step(loss)
            else:
                engine.backward(loss)
                engine.step()
        fake.synchronize(dev)
        per[linked].append((time.perf_counter() - t0) / steps)
    return median(per[True]), median(per[False])


def _budget_run(
    name, cfg, budget, data, fake, gbps, warmup, steps, dtype, beside
) -> dict[str, Any]:
    import torch

    import pstar_core
    from pstar_core.models import build

    torch.manual_seed(0)
    engine = pstar_core.initialize(
        lambda: build(cfg),
        {"dtype": dtype, "device": "fakegpu", "memory": {"device_budget": budget}},
    )
    dev = engine.device
    with_link, without, beside_chunks = [], [], []
    try:
        for i, x in enumerate(data):
            linked = i < warmup or (i - warmup) % 2 == 0
            fake.set_link(gbps if linked else 0.0)
            record = _step(engine, x, fake, dev, beside)
            if i >= warmup:
                (with_link if linked else without).append(record)
                if linked:  # (without a link a copy stays queued until waited for)
                    beside_chunks.append(engine.stats()["adam_beside_backward_chunks"])
        free_with, free_without = _free_running(
            engine, data[warmup:], fake, dev, gbps, steps, beside
        )
        st = engine.stats()
    finally:  # the link is process-wide: off again whatever happened
        fake.set_link(0.0)
        engine.close()
    phases = {}
    for phase in PHASES:
        issued = median([r[phase]["issued_s"] for r in with_link])
        exposed = median([r[phase]["exposed_s"] for r in with_link])
        phases[phase] = {
            "issued_s": issued,
            "exposed_s": exposed,
            "hidden_fraction": 1 - exposed / issued if issued > 0 else None,
            "wall_s": median([r[phase]["wall_s"] for r in with_link]),
            "wall_s_without_link": median([r[phase]["wall_s"] for r in without]),
        }
    step_with = median([sum(r[p]["wall_s"] for p in PHASES) for r in with_link])
    step_without = median([sum(r[p]["wall_s"] for p in PHASES) for r in without])
    fwd_bwd_issued = sum(phases[p]["issued_s"] for p in ("forward", "backward"))
    fwd_bwd_exposed = sum(phases[p]["exposed_s"] for p in ("forward", "backward"))
    opt = phases["optimizer"]
    return {
        "budget": budget,
        "phases": phases,
        "step_s_with_link": step_with,
        "step_s_without_link": step_without,
        "link_slowdown_phases": step_with / step_without,
        "free_step_s_with_link": free_with,
        "free_step_s_without_link": free_without,
        "link_slowdown": free_with / free_without,
        "hidden_fraction_fwd_bwd": (
            1 - fwd_bwd_exposed / fwd_bwd_issued if fwd_bwd_issued > 0 else None
        ),
        "optimizer_over_max": opt["wall_s"] / max(opt["issued_s"], opt["wall_s_without_link"]),
        "device_adam_chunks": st["device_adam_chunks"],
        # chunks whose Adam ran beside backward, per timed step with the link (median)
        "adam_beside_backward_chunks": median(beside_chunks),
        "own_chunks": st["chunks"]["param"]["count"],
        "bytes_moved": st["bytes_moved"],
        "name": name,
    }


def _forecast(cfg, r: dict[str, Any], chunk: int, gbps: float, batch: int, dtype: str):
    """The planner's forecast (`forecast.Rates`, issue 32 item 6) of one budget's run,
    from what the run measured without the link: host Adam's rate is its chunks over the
    optimizer phase's time, the compute rate the model's FLOPs over the rest of a
    free-running step (the phases' own synchronizations cost up to 10% here); the link
    is the modeled one."""
    import torch

    from pstar_core.capacity import Workload, arch_of, module_tensors, tensors_forecast
    from pstar_core.forecast import Rates
    from pstar_core.models import GPT

    with torch.device("meta"):
        t = module_tensors(GPT(cfg), arch_of(cfg), cfg.seq_len)
    work = Workload(batch, cfg.seq_len, False, dtype, chunk)
    ph = r["phases"]
    flops = tensors_forecast(t, r["budget"], 1, work, chunk).flops
    on_host = (r["own_chunks"] - r["device_adam_chunks"]) * chunk
    adam_s = ph["optimizer"]["wall_s_without_link"]
    rates = Rates(
        flops / max(1e-9, r["free_step_s_without_link"] - adam_s),
        gbps * 1e9,
        gbps * 1e9,
        on_host / adam_s if on_host else math.inf,
        latency_s=0.0,
    )
    return tensors_forecast(t, r["budget"], 1, work, chunk, rates=rates)


def run(
    model: str = "gpt-small",
    layers: int | None = 8,
    vocab: int | None = 2048,
    steps: int = 4,
    warmup: int = 2,
    batch: int = 4,
    seq: int = 128,
    gbps: float | None = None,
    dtype: str = "auto",
    beside: bool = True,
    json_out: bool = False,
) -> dict[str, Any]:
    import dataclasses

    import torch

    import pstar_core
    from pstar_core.models import build, get_config

    console = Console(stderr=True)
    fake = fake_device("bench overlap")
    dtype = bench_dtype(dtype)
    load_before = load_avg()
    cfg = dataclasses.replace(get_config(model), seq_len=seq)
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    if vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        for _ in range(warmup + 2 * steps)
    ]
    # the probe: the sizes a budget is made of, and one layer's forward time
    fake.set_link(0.0)
    torch.manual_seed(0)
    probe = pstar_core.initialize(lambda: build(cfg), {"dtype": dtype, "device": "fakegpu"})
    forward_s = []
    for x in data[:5]:
        record = _step(probe, x, fake, probe.device)
        forward_s.append(record["forward"]["wall_s"])
    st = probe.stats()
    probe.close()
    chunk = st["chunk_size"]
    chunk_bytes = chunk * torch.empty((), dtype=pstar_core.config.DTYPES[dtype]).element_size()
    # the first steps record the trace and warm the allocator: measured up to 2x slower
    layer_s = median(forward_s[2:]) / cfg.num_layers
    if gbps is None:
        gbps = chunk_bytes / layer_s / 1e9  # a chunk's copy takes one layer's forward
    runs = {
        name: _budget_run(name, cfg, budget, data, fake, gbps, warmup, steps, dtype, beside)
        for name, budget in budgets(st, "fakegpu").items()
    }
    for r in runs.values():
        f = _forecast(cfg, r, chunk, gbps, batch, dtype)
        r["forecast_step_s"], r["forecast_phases_s"] = f.step_seconds, f.phase_seconds
        r["forecast_over_measured"] = f.step_seconds / r["free_step_s_with_link"]
    table = Table(title=f"copy time hidden on fakegpu, link {gbps:.3f} GB/s each way")
    for col in ("budget", "phase", "issued s", "exposed s", "hidden", "wall s (no link)"):
        table.add_column(col)
    for name, r in runs.items():
        for phase, ph in r["phases"].items():
            hidden = ph["hidden_fraction"]
            table.add_row(
                name,
                phase,
                f"{ph['issued_s']:.4f}",
                f"{ph['exposed_s']:.4f}",
                "-" if hidden is None else f"{hidden:.2f}",
                f"{ph['wall_s']:.4f} ({ph['wall_s_without_link']:.4f})",
            )
        table.add_row(
            name,
            "step",
            "",
            "",
            "",
            f"{r['step_s_with_link']:.4f} ({r['step_s_without_link']:.4f}): "
            f"x{r['link_slowdown_phases']:.2f}",
        )
        table.add_row(
            name,
            "free-running step",
            "",
            "",
            "",
            f"{r['free_step_s_with_link']:.4f} ({r['free_step_s_without_link']:.4f}): "
            f"x{r['link_slowdown']:.2f}",
        )
        table.add_row(
            name,
            "planner's forecast",
            "",
            "",
            "",
            f"{r['forecast_step_s']:.4f}: x{r['forecast_over_measured']:.2f} the measured",
        )
    console.print(table)

    def worst(key: str, low_is_bad: bool) -> float | None:
        values = [r[key] for r in runs.values() if r[key] is not None and math.isfinite(r[key])]
        if not values:
            return None
        return min(values) if low_is_bad else max(values)

    result = {
        "model": model,
        "layers": cfg.num_layers,
        "vocab": cfg.vocab_size,
        "tokens_per_step": batch * seq,
        "link_GBps": gbps,
        "chunk_bytes": chunk_bytes,
        "layer_forward_s": layer_s,
        "adam_beside_backward": beside,
        "runs": runs,
        "hidden_fraction_fwd_bwd": worst("hidden_fraction_fwd_bwd", low_is_bad=True),
        "optimizer_over_max": worst("optimizer_over_max", low_is_bad=False),
        "link_slowdown": worst("link_slowdown", low_is_bad=False),
        # the planner's step time over the measured free-running one, the farther from 1
        "forecast_over_measured": max(
            (r["forecast_over_measured"] for r in runs.values()), key=lambda x: abs(x - 1)
        ),
        **machine(dtype),
    }
    return finish(console, result, load_before, load_avg(), json_out)
