"""`pstar doctor --gpu`: the acceptance run for a GPU machine.

No machine where this project is developed has a GPU, so every CUDA path (device tier,
pinned pool, copy stream, NCCL, fused Adam, the tracer's allocator readings) is written to
the documentation and checked on CPU by invariants only. This script is what someone with
1-8 GPUs runs (in well under 30 minutes) to find out whether they hold; each check prints
pass/fail with its numbers, and the last line is one JSON object to paste into an issue.

Checks (on `cuda:0`, a small GPT; `--device cpu` runs the same code on the CPU, where the
CUDA-only checks say 'skip', so the script itself stays tested):
- placement: after a short run, chunks on the device tier are on the device, host chunks
  in the pinned pool, losses finite;
- parity: the same seed on the device and on the CPU (fp32, TF32 off) gives the same
  losses within 1e-3 relative;
- tracer: N_i of the trace against the allocator's own reading (memory allocated minus
  chunk bytes) sampled once each operator's chunks are in place: never above N_i;
- budget: a device budget that forces eviction, under
  `torch.cuda.set_per_process_memory_fraction`, trains without running out of memory and
  its allocator peak stays within the budget plus the safety margin;
- pinned: the pinned pool's bytes against the host tier's, no chunk outside it;
- overlap: a profile of one step with prefetch: time the copy stream's host-to-device
  copies run while compute kernels run;
- adam: the engine's device Adam against `torch._fused_adamw_` on the same tensors (GB/s);
- nccl: with 2+ GPUs, two NCCL ranks equal one rank with the global batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import finish, load_avg
from pstar_core.models import build, get_config

STEPS = 4
CHUNK = 1 << 18  # elements per chunk
SEQ = 128  # tokens per sequence
MODEL = dataclasses.replace(get_config("gpt-small"), num_layers=4, vocab_size=1024)
CUDA_ONLY = "skip (needs CUDA)"


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "pass", "fail", or "skip (...)"
    numbers: dict[str, Any]
    detail: str = ""


def _batches(n: int, batch: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL.vocab_size, (batch, SEQ), generator=g) for _ in range(n)]


def _engine(device: str, memory: dict[str, Any] | None = None, dtype: str = "bf16"):
    torch.manual_seed(0)
    cfg = MODEL
    return pstar_core.initialize(
        lambda: build(cfg),
        {
            "dtype": dtype,
            "device": device,
            "chunk_size": CHUNK,
            "optimizer": {"lr": 1e-3},
            "memory": memory or {},
        },
    )


def _train(engine, data: list[torch.Tensor], on_operator: Callable[[], None] | None = None):
    losses = []
    if on_operator is not None:
        orig = engine.manager.access_slots

        def access(slots, forward=False):
            orig(slots, forward)
            on_operator()

        engine.manager.access_slots = access
    try:
        for x in data:
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
    finally:
        if on_operator is not None:
            del engine.manager.access_slots
    return losses


def check_placement(device: str) -> Check:
    engine = _engine(device)
    losses = _train(engine, _batches(STEPS))
    dev = torch.device(device)
    wrong = []
    for c in engine.manager.chunks():
        if c.payload is None:
            continue
        want = dev.type if c.tier == "device" else "cpu"
        if c.payload.device.type != want:
            wrong.append(f"{c.kind.value}.{c.index} on {c.payload.device} in tier {c.tier}")
    pinned_ok = True
    if dev.type == "cuda":  # pragma: no cover - CUDA only
        pinned_ok = all(c.payload.is_pinned() for c in engine.manager.chunks() if c.tier == "host")
    engine.close()
    ok = not wrong and pinned_ok and all(math.isfinite(x) for x in losses)
    return Check(
        "placement",
        "pass" if ok else "fail",
        {"losses": [round(x, 4) for x in losses], "misplaced": len(wrong), "pinned": pinned_ok},
        "; ".join(wrong[:3]),
    )


def check_parity(device: str) -> Check:
    if torch.device(device).type != "cuda":
        return Check("parity", CUDA_ONLY, {})
    torch.backends.cuda.matmul.allow_tf32 = False  # pragma: no cover - CUDA only
    torch.backends.cudnn.allow_tf32 = False  # pragma: no cover
    data = _batches(STEPS)  # pragma: no cover
    on_gpu = _train(_engine(device, dtype="fp32"), data)  # pragma: no cover
    on_cpu = _train(_engine("cpu", dtype="fp32"), data)  # pragma: no cover
    rel = max(abs(a - b) / abs(b) for a, b in zip(on_gpu, on_cpu, strict=True))  # pragma: no cover
    return Check(  # pragma: no cover
        "parity", "pass" if rel < 1e-3 else "fail", {"max_rel_diff": rel, "gpu": on_gpu}
    )


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":  # pragma: no cover - CUDA only
        return torch.cuda.memory_allocated(device)
    return -1


def check_tracer(device: str) -> Check:
    dev = torch.device(device)
    if dev.type != "cuda":
        return Check("tracer", CUDA_ONLY, {})
    engine = _engine(device)  # pragma: no cover - CUDA only
    samples: dict[int, int] = {}  # pragma: no cover

    def sample() -> None:  # pragma: no cover - CUDA only
        m = engine.manager
        if m.tracer.following:
            i = m.tracer.moment
            chunks = m.residency.tiers["device"].used_bytes
            samples[i] = max(samples.get(i, 0), _allocated(dev) - chunks)

    _train(engine, _batches(STEPS), sample)  # pragma: no cover
    trace = engine.manager.tracer.trace  # pragma: no cover
    over = [  # pragma: no cover
        (i, s - trace.non_model[i]) for i, s in samples.items() if s > trace.non_model[i]
    ]
    engine.close()  # pragma: no cover
    return Check(  # pragma: no cover
        "tracer",
        "pass" if samples and not over else "fail",
        {"moments_sampled": len(samples), "above_N_i": len(over), "peak_N": trace.peak_non_model},
        f"first above: moment {over[0][0]} by {over[0][1]} bytes" if over else "",
    )


def check_budget(device: str) -> Check:
    dev = torch.device(device)
    probe = _engine(device)
    _train(probe, _batches(2))
    st = probe.stats()
    probe.close()
    n, params = st["tracer"]["peak_non_model_bytes"], st["chunks"]["param"]["bytes"]
    budget = int(n + 0.5 * params)
    if dev.type == "cuda":  # pragma: no cover - CUDA only
        total = torch.cuda.get_device_properties(dev).total_memory
        baseline = torch.cuda.memory_allocated(dev)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (baseline + 2 * budget) / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
    engine = _engine(device, {"device_budget": budget})
    try:
        losses = _train(engine, _batches(STEPS))
    except torch.OutOfMemoryError as e:  # pragma: no cover - CUDA only
        return Check("budget", "fail", {"budget": budget}, f"out of memory: {e}")
    finally:
        if dev.type == "cuda":  # pragma: no cover - CUDA only
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    moved = engine.stats()["bytes_moved"].get("device->host", 0)
    numbers: dict[str, Any] = {"budget": budget, "evicted_bytes": moved, "loss": losses[-1]}
    ok = moved > 0 and math.isfinite(losses[-1])
    if dev.type == "cuda":  # pragma: no cover - CUDA only
        peak = torch.cuda.max_memory_allocated(dev)
        numbers["allocator_peak"] = peak
        ok = ok and peak <= budget / engine.config.memory.device_safety + (64 << 20)
    else:
        peak = engine.manager.residency.tiers["device"].peak_bytes
        numbers["chunk_peak"] = peak
        ok = ok and peak <= budget
    engine.close()
    return Check("budget", "pass" if ok else "fail", numbers)


def check_pinned(device: str) -> Check:
    engine = _engine(device)
    _train(engine, _batches(2))
    pool = engine.stats()["host_pool"]
    host = engine.manager.residency.tiers["host"]
    engine.close()
    if torch.device(device).type != "cuda":
        return Check("pinned", CUDA_ONLY, {"host_pool": pool})
    ok = pool is not None and pool["fallbacks"] == 0  # pragma: no cover - CUDA only
    return Check(  # pragma: no cover - CUDA only
        "pinned",
        "pass" if ok else "fail",
        {**(pool or {}), "host_tier_used": host.used_bytes, "host_tier_peak": host.peak_bytes},
    )


def check_overlap(device: str) -> Check:
    dev = torch.device(device)
    if dev.type != "cuda":
        return Check("overlap", CUDA_ONLY, {})
    from torch.profiler import ProfilerActivity, profile  # pragma: no cover - CUDA only

    probe = _engine(device)  # pragma: no cover
    _train(probe, _batches(2))  # pragma: no cover
    st = probe.stats()  # pragma: no cover
    probe.close()  # pragma: no cover
    budget = int(st["tracer"]["peak_non_model_bytes"] + 0.5 * st["chunks"]["param"]["bytes"])
    engine = _engine(device, {"device_budget": budget})  # pragma: no cover
    data = _batches(3)  # pragma: no cover
    _train(engine, data[:2])  # pragma: no cover
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]  # pragma: no cover
    with profile(activities=acts) as prof:  # pragma: no cover
        _train(engine, data[2:])
        torch.cuda.synchronize(dev)
    copies, kernels = [], []  # pragma: no cover
    for e in prof.events():  # pragma: no cover
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (copies if "Memcpy HtoD" in e.name else kernels).append(span)
    overlap_us = sum(  # pragma: no cover
        max(0, min(c1, k1) - max(c0, k0)) for c0, c1 in copies for k0, k1 in kernels
    )
    copy_us = sum(c1 - c0 for c0, c1 in copies)  # pragma: no cover
    prefetched = engine.stats()["prefetched"]  # pragma: no cover
    engine.close()  # pragma: no cover
    return Check(  # pragma: no cover
        "overlap",
        "pass" if overlap_us > 0 else "fail",
        {"copy_ms": copy_us / 1e3, "overlapped_ms": overlap_us / 1e3, "prefetched": prefetched},
    )


def check_adam(device: str) -> Check:
    from pstar_core.kernels import AdamSegment, adamw_

    dev = torch.device(device)
    n = 1 << 22
    segs = [AdamSegment(i * (n // 8), n // 8, 3, 1e-3, 0.01) for i in range(8)]

    def bufs():
        g = torch.Generator().manual_seed(1)
        master = torch.randn(n, generator=g).to(dev)
        return master, torch.zeros(n, device=dev), torch.zeros(n, device=dev)

    master, m, v = bufs()
    grad = torch.randn(n, dtype=torch.bfloat16).to(dev)

    def ours() -> None:
        adamw_(master, m, v, grad, grad, segs, beta1=0.9, beta2=0.95, eps=1e-8)

    p2, m2, v2 = bufs()
    g32 = grad.float()
    params = [p2[s.offset : s.offset + s.numel] for s in segs]
    grads = [g32[s.offset : s.offset + s.numel] for s in segs]
    ms = [m2[s.offset : s.offset + s.numel] for s in segs]
    vs = [v2[s.offset : s.offset + s.numel] for s in segs]
    steps = [torch.tensor(3.0, device=dev) for _ in segs]

    def fused() -> None:
        torch._fused_adamw_(
            params, grads, ms, vs, [], steps, lr=1e-3, beta1=0.9, beta2=0.95,
            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    def timed(fn: Callable[[], None]) -> float:
        fn()
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return (time.perf_counter() - t0) / 5

    # per element: master, m, v read and written (24 B) + bf16 grad read and param written
    gb = n * 28 / 1e9
    ours_s, fused_s = [], []
    for _ in range(3):  # interleaved, medians
        ours_s.append(timed(ours))
        fused_s.append(timed(fused))
    ours_gbs, fused_gbs = gb / sorted(ours_s)[1], gb / sorted(fused_s)[1]
    ratio = ours_gbs / fused_gbs
    numbers = {"ours_GBps": round(ours_gbs, 1), "fused_GBps": round(fused_gbs, 1)}
    numbers["ratio"] = round(ratio, 3)
    if dev.type != "cuda":
        return Check("adam", "skip (CPU: the C++ kernel runs; numbers for reference)", numbers)
    return Check("adam", "pass" if ratio >= 0.8 else "fail", numbers)  # pragma: no cover


def _nccl_worker(rank: int, world: int, tmp: str) -> None:  # pragma: no cover - CUDA only
    import json

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    engine = _engine("cuda", dtype="fp32")
    data = [x.chunk(world)[rank] for x in _batches(STEPS, batch=4)]
    losses = _train(engine, data)
    t = torch.tensor(losses, device=f"cuda:{rank}")
    dist.all_reduce(t)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps((t / world).tolist()))
    dist.destroy_process_group()


def check_nccl(device: str) -> Check:
    if torch.device(device).type != "cuda":
        return Check("nccl", CUDA_ONLY, {})
    if torch.cuda.device_count() < 2:  # pragma: no cover - CUDA only
        return Check("nccl", "skip (needs 2 GPUs)", {"gpus": torch.cuda.device_count()})
    import json  # pragma: no cover - CUDA only

    import torch.multiprocessing as mp  # pragma: no cover

    torch.backends.cuda.matmul.allow_tf32 = False  # pragma: no cover
    single = _train(_engine(device, dtype="fp32"), _batches(STEPS, batch=4))  # pragma: no cover
    with tempfile.TemporaryDirectory() as tmp:  # pragma: no cover
        mp.spawn(_nccl_worker, args=(2, tmp), nprocs=2)
        two = json.loads(Path(tmp, "rank0.json").read_text())
    rel = max(abs(a - b) / abs(b) for a, b in zip(two, single, strict=True))  # pragma: no cover
    return Check(  # pragma: no cover
        "nccl", "pass" if rel < 1e-4 else "fail", {"max_rel_diff": rel, "two_ranks": two}
    )


CHECKS = (
    check_placement,
    check_parity,
    check_tracer,
    check_budget,
    check_pinned,
    check_overlap,
    check_adam,
    check_nccl,
)


def run(device: str = "cuda", json_out: bool = False) -> dict[str, Any]:
    """Run every check on `device`; the result (also printed as a table and JSON)."""
    console = Console(stderr=True)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        result = {
            "gpu": False,
            "torch": torch.__version__,
            "error": "torch sees no CUDA device: nothing to check (a CPU build of torch, or "
            "no GPU visible to this process)",
        }
        console.print(f"[red]{result['error']}")
        return finish(console, result, load_avg(), load_avg(), json_out)
    load_before = load_avg()
    t0 = time.perf_counter()
    env: dict[str, Any] = {"torch": torch.__version__, "device": device}
    if torch.device(device).type == "cuda":  # pragma: no cover - CUDA only
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
    checks: list[Check] = []
    for fn in CHECKS:
        start = time.perf_counter()
        try:
            c = fn(device)
        except Exception as e:  # a check that crashes is a failed check, with its trace
            tb = traceback.format_exc().strip().splitlines()
            c = Check(fn.__name__.removeprefix("check_"), "fail", {}, f"{e!r} at {tb[-3:]}")
        c.numbers["seconds"] = round(time.perf_counter() - start, 2)
        checks.append(c)
        console.print(f"[dim]{c.name}: {c.status}")
    table = Table(title=f"pstar doctor on {device}")
    for col in ("check", "status", "numbers", "detail"):
        table.add_column(col)
    for c in checks:
        style = {"pass": "green", "fail": "red"}.get(c.status, "yellow")
        shown = ", ".join(f"{k}={v}" for k, v in c.numbers.items() if k != "losses")
        table.add_row(c.name, f"[{style}]{c.status}", shown, c.detail)
    console.print(table)
    failed = [c.name for c in checks if c.status == "fail"]
    result = {
        "gpu": torch.device(device).type == "cuda",
        **env,
        "passed": [c.name for c in checks if c.status == "pass"],
        "failed": failed,
        "checks": {c.name: {"status": c.status, **c.numbers, "detail": c.detail} for c in checks},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return finish(console, result, load_before, load_avg(), json_out)
