"""Engine overhead benchmark: pstar_core engine step time vs. plain PyTorch, same GPT.

Training recipes of the same zoo GPT, with the same initial weights and the same token
batches, are timed step by step (forward + backward + optimizer step each), all in one
dtype (``--dtype``, default auto: what the engine picks on this CPU):

- ``engine``: ``pstar_core.initialize`` (params in chunks of the dtype, fp32
  masters/moments in chunks, hooks, the host AdamW kernel chosen for this CPU);
- ``torch <dtype>+fp32 master`` (bf16 or fp16 only): the equivalent plain recipe and the
  fair baseline there: params in the dtype, fp32 master copies updated by
  ``torch.optim.AdamW(fused=True)`` from ``.float()`` grads, then copied back;
- ``torch fp32``: plain fp32 model with ``torch.optim.AdamW(fused=True)``. In fp32 it is
  the fair baseline (the engine's fp32 is fp32 params + fp32 masters, and a master copy of
  an fp32 param would be the param itself), and the master recipe is not run.

``--device fakegpu`` runs every recipe on the test suite's second device (a device with
streams, as a GPU: the engine's per-operator prefetch bookkeeping runs there, and not on
the CPU, where nothing can be copied ahead); the ratio then is host overhead against the
same kernels, with the fake device's own per-op cost on both sides.

All models live at once and the runs are interleaved in one process, one whole step
each per round, with the order alternating between rounds (A B C, C B A, ...) so slow
drift of a shared, noisy machine hits every recipe alike. Reported: medians of per-step
times, the ratio engine ÷ baseline of the medians, the min/max of the paired per-round
ratios (spread), the dtype each recipe was seen computing in, the load average
before/after, the CPU's capability and torch's thread count.

    python -c "from benchmarks.overhead import run; run(json_out=True)"
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import (
    bench_dtype,
    fake_device,
    finish,
    load_avg,
    machine,
    median,
    torch_dtype,
    watch_compute_dtype,
)
from pstar_core.models import GPTConfig, build, get_config, num_params

__all__ = ["run"]

ENGINE, FP32 = "engine", "torch fp32"
_LR, _WD = 1e-4, 0.0


def master_recipe(dtype: str) -> str:
    """The name of the plain recipe with `dtype` params and fp32 masters."""
    return f"torch {dtype}+fp32 master"


@dataclass
class _Runner:
    """One training recipe: ``fwd(x) -> loss``, ``bwd(loss)``, ``opt()``, and its timings."""

    name: str
    fwd: Callable[[torch.Tensor], torch.Tensor]
    bwd: Callable[[torch.Tensor], None]
    opt: Callable[[], None]
    seen_dtype: Callable[[], str | None]  # what its first linear layer computed in
    steps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds (all threads)
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def step(self, x: torch.Tensor, record: bool, sync: Callable[[], None]) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.fwd(x)
        sync()
        t1 = time.perf_counter()
        self.bwd(loss)
        sync()
        t2 = time.perf_counter()
        self.opt()
        sync()
        t3, c3 = time.perf_counter(), time.process_time()
        if record:
            self.steps.append(t3 - t0)
            self.cpu.append(c3 - c0)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))
            self.losses.append(float(loss.detach()))


def _engine_runner(
    cfg: GPTConfig,
    dtype: str,
    state: dict[str, torch.Tensor],
    device: str,
    chunk_size: int | str = "auto",
    name: str = ENGINE,
) -> tuple[_Runner, Any]:
    engine = pstar_core.initialize(
        lambda: build(cfg),
        {
            "dtype": dtype,
            "device": device,
            "chunk_size": chunk_size,
            "optimizer": {"lr": _LR, "weight_decay": _WD},
        },
    )
    engine.load_state_dict(state)
    seen = watch_compute_dtype(engine.module)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=x, labels=x).loss

    return _Runner(name, fwd, engine.backward, engine.step, seen), engine


def _master_runner(
    cfg: GPTConfig, dtype: str, state: dict[str, torch.Tensor], device: str
) -> _Runner:
    """Params in `dtype` + fp32 masters + fused AdamW on the masters, copied back (the
    engine's math in bf16/fp16)."""
    net = build(cfg)
    net.load_state_dict(state)
    net.to(device)
    params = list(net.parameters())  # deduplicated: the tied wte/lm_head weight once
    masters = [p.detach().clone().float() for p in params]
    net.to(torch_dtype(dtype))  # in place (param.data), so the weight tie survives
    opt = torch.optim.AdamW(masters, lr=_LR, weight_decay=_WD, fused=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device)
        return net(input_ids=x, labels=x).loss

    def bwd(loss: torch.Tensor) -> None:
        loss.backward()

    def step() -> None:
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        for m in masters:
            m.grad = None
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    return _Runner(master_recipe(dtype), fwd, bwd, step, watch_compute_dtype(net))


def _fp32_runner(cfg: GPTConfig, state: dict[str, torch.Tensor], device: str) -> _Runner:
    net = build(cfg)
    net.load_state_dict(state)
    net.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=_LR, weight_decay=_WD, fused=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device)
        return net(input_ids=x, labels=x).loss

    def bwd(loss: torch.Tensor) -> None:
        loss.backward()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _Runner(FP32, fwd, bwd, step, watch_compute_dtype(net))


def run(
    model: str = "gpt-100m",
    batch: int = 1,
    seq: int = 320,
    steps: int = 5,
    warmup: int = 2,
    dtype: str = "auto",
    json_out: bool = False,
    device: str = "cpu",
    layers: int = 0,
    chunk_size: int = 0,
) -> dict[str, Any]:
    """Time engine vs. plain-PyTorch training steps of ``model``; print a table, return a dict.

    ``ratio`` is engine ÷ the fair baseline (``baseline``: the dtype+fp32-master recipe in
    bf16/fp16, plain fp32 torch in fp32); ``ratio_vs_fp32`` is engine ÷ plain fp32
    PyTorch. ``chunk_size`` (elements, 0: none) adds a second engine with chunks of that
    size, interleaved with the rest: the tensors larger than it span chunks, and
    ``spanned_over_engine`` is its step time ÷ the engine's (whose chunks hold every
    tensor). With ``json_out`` the last line printed is one JSON object with the numbers.
    """
    dtype = bench_dtype(dtype)
    if steps < 1 or warmup < 0 or batch < 1 or seq < 2:
        raise ValueError("need steps >= 1, warmup >= 0, batch >= 1, seq >= 2")
    cfg = get_config(model)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    if seq > cfg.seq_len:
        raise ValueError(f"seq {seq} exceeds {model}'s seq_len {cfg.seq_len}")
    n_params = num_params(cfg)
    master = master_recipe(dtype)
    if device.startswith("fakegpu"):
        fake_device("bench overhead --device fakegpu")
    elif device != "cpu":
        raise ValueError(f"device {device!r}: this bench runs on cpu or fakegpu")

    def sync() -> None:
        if device != "cpu":
            torch.accelerator.synchronize()

    torch.manual_seed(0)
    state = build(cfg).state_dict()  # one fp32 init shared by all recipes
    engine_runner, engine = _engine_runner(cfg, dtype, state, device)
    runners = [engine_runner]
    if dtype != "fp32":
        runners.append(_master_runner(cfg, dtype, state, device))
    runners.append(_fp32_runner(cfg, state, device))
    baseline = runners[1]
    spanned = None
    if chunk_size:
        name = f"engine, chunks of {chunk_size}"
        spanned_runner, spanned = _engine_runner(cfg, dtype, state, device, chunk_size, name)
        runners.append(spanned_runner)
    del state
    gc.collect()

    gen = torch.Generator().manual_seed(1234)

    def batch_ids() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)

    # Warm-up (the engine's first step may JIT-build the C++ Adam kernel), same data for all.
    for _ in range(warmup):
        x = batch_ids()
        for r in runners:
            r.step(x, record=False, sync=sync)
    gc.collect()

    load_before = load_avg()
    for i in range(steps):
        x = batch_ids()
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            r.step(x, record=True, sync=sync)
    load_after = load_avg()

    eng = runners[0]
    med = {r.name: median(r.steps) for r in runners}
    spreads = {
        r.name: [e / b for e, b in zip(eng.steps, r.steps, strict=True)] for r in runners[1:]
    }
    tokens = batch * seq
    result: dict[str, Any] = {
        "model": model,
        "device": device,
        "layers": cfg.num_layers,
        "params": n_params,
        "dtype": dtype,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "warmup": warmup,
        "baseline": baseline.name,
        "engine_s": med[ENGINE],
        "baseline_s": med[baseline.name],
        "torch_master_s": med.get(master),  # None in fp32: not run
        "torch_fp32_s": med[FP32],
        "ratio": med[ENGINE] / med[baseline.name],
        "ratio_vs_fp32": med[ENGINE] / med[FP32],
        # CPU time is less sensitive than wall time to other processes on a shared machine.
        "cpu_s": {r.name: median(r.cpu) for r in runners},
        "ratio_cpu": median(eng.cpu) / median(baseline.cpu),
        "ratio_spread": [min(spreads[baseline.name]), max(spreads[baseline.name])],
        "ratio_vs_fp32_spread": [min(spreads[FP32]), max(spreads[FP32])],
        "tokens_per_s": {r.name: tokens / med[r.name] for r in runners},
        "phases_s": {
            r.name: dict(
                zip(
                    ("fwd", "bwd", "opt"),
                    (median([p[k] for p in r.phases]) for k in range(3)),
                    strict=False,
                )
            )
            for r in runners
        },
        "step_times_s": {r.name: r.steps for r in runners},
        "final_loss": {r.name: r.losses[-1] for r in runners},
        # what each recipe's first linear layer computed in, and what the engine resolved
        "seen_compute_dtype": {r.name: r.seen_dtype() for r in runners},
        "engine_dtype": engine.stats()["precision"]["dtype"],
        "not_run": {master: "fp32: the params are the masters"} if dtype == "fp32" else {},
        **machine(dtype),
        "load_avg": {"before": load_before, "after": load_after},
    }
    if spanned is not None:
        result["chunk_size"] = {ENGINE: engine.plan.chunk_size, runners[-1].name: chunk_size}
        result["spanning"] = [name for name, _ in spanned.plan.spanning]
        result["spanned_over_engine"] = med[runners[-1].name] / med[ENGINE]
        result["spanned_losses_equal"] = runners[-1].losses == eng.losses
        spanned.close()
    engine.close()

    table = Table(
        title=(
            f"pstar engine overhead: {model} ({n_params / 1e6:.1f}M params), {dtype} on "
            f"{device}, CPU {result['cpu_capability']} ({result['torch_threads']} threads), "
            f"batch {batch} x seq {seq}, {steps} interleaved steps after {warmup} warm-up; "
            f"baseline {baseline.name}"
        )
    )
    for col in (
        "recipe",
        "median s/step",
        "cpu s/step",
        "fwd s",
        "bwd s",
        "opt s",
        "tokens/s",
        "engine ÷ row",
        "paired min..max",
        "loss",
    ):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for r in runners:
        ph = result["phases_s"][r.name]
        sp = spreads.get(r.name)
        table.add_row(
            r.name + (" (baseline)" if r is baseline else ""),
            f"{med[r.name]:.3f}",
            f"{median(r.cpu):.3f}",
            f"{ph['fwd']:.3f}",
            f"{ph['bwd']:.3f}",
            f"{ph['opt']:.3f}",
            f"{tokens / med[r.name]:.0f}",
            f"{med[ENGINE] / med[r.name]:.3f}",
            "-" if sp is None else f"{min(sp):.3f}..{max(sp):.3f}",
            f"{r.losses[-1]:.4f}",
        )
    if dtype == "fp32":
        table.add_row(f"{master}: not run", *["-"] * 9)
        table.caption = (
            f"{master} is not run in fp32: the params are the masters (the engine's fp32 is "
            f"fp32 params + fp32 masters), so its fair baseline is plain {FP32} + fused AdamW"
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    return finish(console, result, load_before, load_after, json_out)


if __name__ == "__main__":
    run(json_out=True)
