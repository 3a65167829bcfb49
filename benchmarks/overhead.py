"""Engine overhead benchmark: pstar_core engine step time vs. plain PyTorch, same GPT.

Three training recipes of the same zoo GPT, with the same initial weights and the same
token batches, are timed step by step (forward + backward + optimizer step each):

- ``engine``: ``pstar_core.initialize`` (params in bf16 chunks, fp32 masters/moments in
  chunks, hooks, fused C++ chunk AdamW);
- ``torch bf16+fp32 master``: the equivalent plain recipe and the fair baseline: bf16
  params (compute in bf16), fp32 master copies updated by ``torch.optim.AdamW(fused=True)``
  from ``.float()`` grads, then copied back into the bf16 params;
- ``torch fp32``: plain fp32 model with ``torch.optim.AdamW(fused=True)``.

All three models live at once and the runs are interleaved in one process, one whole step
each per round, with the order alternating between rounds (A B C, C B A, ...) so slow
drift of a shared, noisy machine hits every recipe alike. Reported: medians of per-step
times, the ratio engine ÷ baseline of the medians, the min/max of the paired per-round
ratios (spread), the load average before/after and torch's thread count.

    python -c "from benchmarks.overhead import run; run(json_out=True)"
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import finish, median
from pstar_core.models import build, get_config, num_params

__all__ = ["run"]

ENGINE, MASTER, FP32 = "engine", "torch bf16+fp32 master", "torch fp32"
_LR, _WD = 1e-4, 0.0
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class _Runner:
    """One training recipe: ``fwd(x) -> loss``, ``bwd(loss)``, ``opt()``, and its timings."""

    name: str
    fwd: Callable[[torch.Tensor], torch.Tensor]
    bwd: Callable[[torch.Tensor], None]
    opt: Callable[[], None]
    steps: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds (all threads)
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def step(self, x: torch.Tensor, record: bool) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.fwd(x)
        t1 = time.perf_counter()
        self.bwd(loss)
        t2 = time.perf_counter()
        self.opt()
        t3, c3 = time.perf_counter(), time.process_time()
        if record:
            self.steps.append(t3 - t0)
            self.cpu.append(c3 - c0)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))
            self.losses.append(float(loss.detach()))


def _engine_runner(model: str, dtype: str, state: dict[str, torch.Tensor]) -> _Runner:
    engine = pstar_core.initialize(
        lambda: build(model),
        {"dtype": dtype, "chunk_size": "auto", "optimizer": {"lr": _LR, "weight_decay": _WD}},
    )
    engine.load_state_dict(state)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=x, labels=x).loss

    return _Runner(ENGINE, fwd, engine.backward, engine.step)


def _master_runner(model: str, dtype: str, state: dict[str, torch.Tensor]) -> _Runner:
    """bf16 params + fp32 masters + fused AdamW on the masters, copied back (the engine's math)."""
    net = build(model)
    net.load_state_dict(state)
    params = list(net.parameters())  # deduplicated: the tied wte/lm_head weight once
    masters = [p.detach().clone().float() for p in params]
    net.to(_DTYPES[dtype])  # in place (param.data), so the weight tie survives
    opt = torch.optim.AdamW(masters, lr=_LR, weight_decay=_WD, fused=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
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

    return _Runner(MASTER, fwd, bwd, step)


def _fp32_runner(model: str, state: dict[str, torch.Tensor]) -> _Runner:
    net = build(model)
    net.load_state_dict(state)
    opt = torch.optim.AdamW(net.parameters(), lr=_LR, weight_decay=_WD, fused=True)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return net(input_ids=x, labels=x).loss

    def bwd(loss: torch.Tensor) -> None:
        loss.backward()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _Runner(FP32, fwd, bwd, step)


def run(
    model: str = "gpt-100m",
    batch: int = 1,
    seq: int = 320,
    steps: int = 5,
    warmup: int = 2,
    dtype: str = "bf16",
    json_out: bool = False,
) -> dict[str, Any]:
    """Time engine vs. plain-PyTorch training steps of ``model``; print a table, return a dict.

    ``ratio`` is engine ÷ the bf16+fp32-master baseline (the equivalent recipe);
    ``ratio_vs_fp32`` is engine ÷ plain fp32 PyTorch. With ``json_out`` the last line
    printed is one JSON object with the returned numbers.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if steps < 1 or warmup < 0 or batch < 1 or seq < 2:
        raise ValueError("need steps >= 1, warmup >= 0, batch >= 1, seq >= 2")
    cfg = get_config(model)
    if seq > cfg.seq_len:
        raise ValueError(f"seq {seq} exceeds {model}'s seq_len {cfg.seq_len}")
    n_params = num_params(cfg)

    torch.manual_seed(0)
    state = build(model).state_dict()  # one fp32 init shared by all three recipes
    runners = [
        _engine_runner(model, dtype, state),
        _master_runner(model, dtype, state),
        _fp32_runner(model, state),
    ]
    del state
    gc.collect()

    gen = torch.Generator().manual_seed(1234)

    def batch_ids() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)

    # Warm-up (the engine's first step may JIT-build the C++ Adam kernel), same data for all.
    for _ in range(warmup):
        x = batch_ids()
        for r in runners:
            r.step(x, record=False)
    gc.collect()

    load_before = os.getloadavg()
    threads = torch.get_num_threads()
    for i in range(steps):
        x = batch_ids()
        order = runners if i % 2 == 0 else runners[::-1]
        for r in order:
            r.step(x, record=True)
    load_after = os.getloadavg()

    eng, mst, f32 = runners
    med = {r.name: median(r.steps) for r in runners}
    paired = [e / b for e, b in zip(eng.steps, mst.steps, strict=True)]
    paired32 = [e / b for e, b in zip(eng.steps, f32.steps, strict=True)]
    tokens = batch * seq
    result: dict[str, Any] = {
        "model": model,
        "params": n_params,
        "dtype": dtype,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "warmup": warmup,
        "engine_s": med[ENGINE],
        "torch_s": med[MASTER],
        "torch_fp32_s": med[FP32],
        "ratio": med[ENGINE] / med[MASTER],
        "ratio_vs_fp32": med[ENGINE] / med[FP32],
        # CPU time is less sensitive than wall time to other processes on a shared machine.
        "cpu_s": {r.name: median(r.cpu) for r in runners},
        "ratio_cpu": median(eng.cpu) / median(mst.cpu),
        "ratio_spread": [min(paired), max(paired)],
        "ratio_vs_fp32_spread": [min(paired32), max(paired32)],
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
        "load_avg": {"before": list(load_before), "after": list(load_after)},
        "threads": threads,
    }

    table = Table(
        title=(
            f"pstar engine overhead: {model} ({n_params / 1e6:.1f}M params), {dtype}, "
            f"batch {batch} x seq {seq}, {steps} interleaved steps after {warmup} warm-up"
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
    spreads = {ENGINE: None, MASTER: paired, FP32: paired32}
    for r in runners:
        ph = result["phases_s"][r.name]
        sp = spreads[r.name]
        table.add_row(
            r.name,
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
    console = Console(width=max(Console().width, 150))
    console.print(table)
    return finish(console, result, load_before, load_after, json_out, f"torch threads {threads}; ")


if __name__ == "__main__":
    run(json_out=True)
