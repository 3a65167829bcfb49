"""`pstar doctor --gpu`: the acceptance run for a GPU machine.

No machine where this project is developed has a GPU. The engine's device paths run in
the CPU tests on a second device with a GPU's capabilities (`tests/fakedevice`), and so
does this script: `--device fakegpu` (from the test suite) runs every check that does
not need CUDA's own profiler or two CUDA devices. On a GPU machine (1-8 GPUs, a few
minutes) it says whether the engine holds there; each check prints pass/fail with its
numbers, each has a time limit of `CHECK_SECONDS` (a hung check fails with its traceback
instead of hanging the run), and the last line is one JSON object to paste into an issue.
`scripts/gpu_check.py` is the one-GPU acceptance run built on these checks (a ~1B model
under two budgets, the baselines, a resume, an NCCL probe), each stage in a process of
its own.

Checks (a small GPT on the device; `--device cpu` runs the script's own code, where what
needs an accelerator says 'skip'):
- placement: after a short run, chunks on the device tier are on the device, host chunks
  in the page-locked pool, losses finite;
- parity: the same seed on the device and on the CPU (fp32; TF32 off for the check and
  restored after) gives the same losses within 1e-3 relative;
- tracer: N_i of the trace against the allocator's own reading (memory allocated minus
  chunk bytes) sampled once each operator's chunks are in place: never above N_i;
- budget: a device budget that forces eviction, with the device limited to the memory
  before the run plus that budget / `memory.device_safety` (CUDA:
  `set_per_process_memory_fraction`), trains without running out of memory, and the
  allocator's *reserved* peak (what the device really holds, fragmentation included)
  stays within that limit;
- mixed_adam: a budget with room for all the param chunks at the peak of the non-model
  memory and two chunks' optimizer states: Adam runs on the device for some chunks and on
  the host for the others in the same steps, within the same limit;
- pinned: under a budget that keeps chunks on the host, every host chunk in the pool the
  engine registered, none outside it;
- overlap: (CUDA) a profile of one step with prefetch: time the copy stream's
  host-to-device copies run while compute kernels (not copies or memsets) run;
- adam: the engine's device Adam (bf16 gradients in the param slot, fp32 states) against
  the same work done with torch ops as a user would (gradients to fp32, torch's fused
  AdamW, the cast back), both counted at the bytes that work moves (40 per element), at
  a size that is bandwidth-bound, not launch-bound: within 0.8x on CUDA (elsewhere the
  numbers only: on the fake device both sides are the CPU's);
- nccl: (2+ CUDA GPUs) two NCCL ranks equal one rank with the global batch, run as two
  processes (each told the host has 2 local ranks) that are killed if they pass their
  time limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.report import finish, load_avg
from pstar_core.devices import Capabilities, capabilities, device_module
from pstar_core.models import build, get_config

STEPS = 4
CHUNK = 1 << 18  # elements per chunk
SEQ = 128  # tokens per sequence
MODEL = dataclasses.replace(get_config("gpt-small"), num_layers=4, vocab_size=1024)
ADAM_ELEMS = 1 << 26  # 64M elements: bandwidth-bound on a GPU (the check's size)
CHECK_SECONDS = 60  # each check's time limit
NEEDS_ACCELERATOR = "skip (needs an accelerator)"
CUDA_ONLY = "skip (needs CUDA)"


def _caps(device: str) -> Capabilities:
    return capabilities(torch.device(device))


def _module(device: str) -> Any:
    return device_module(torch.device(device))


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "pass", "fail", or "skip (...)"
    numbers: dict[str, Any]
    detail: str = ""


def _batches(n: int, batch: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL.vocab_size, (batch, SEQ), generator=g) for _ in range(n)]


DTYPE = "auto"  # the checks' engines compute in what the device does natively


def _engine(device: str, memory: dict[str, Any] | None = None, dtype: str | None = None):
    torch.manual_seed(0)
    cfg = MODEL
    return pstar_core.initialize(
        lambda: build(cfg),
        {
            "dtype": dtype or DTYPE,
            "device": device,
            "chunk_size": CHUNK,
            "optimizer": {"lr": 1e-3},
            "memory": memory or {},
        },
    )


def _train(engine, data: list[torch.Tensor], on_operator: Callable[[], None] | None = None):
    """Train on `data`; `on_operator` runs once each operator's chunks are in place (an
    observer of the manager's Access, `ChunkManager.on_access`)."""
    losses = []
    observers = engine.manager.on_access
    observe = None
    if on_operator is not None:

        def observe(_slots):
            on_operator()

        observers.append(observe)
    try:
        for x in data:
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
    finally:
        if observe is not None:
            observers.remove(observe)
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
    if _caps(device).pinned_host:
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
    if not _caps(device).accelerator:
        return Check("parity", NEEDS_ACCELERATOR, {})
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        data = _batches(STEPS)
        with _engine(device, dtype="fp32") as engine:
            on_device = _train(engine, data)
        with _engine("cpu", dtype="fp32") as engine:
            on_cpu = _train(engine, data)
    finally:  # the other checks run as training would
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    rel = max(abs(a - b) / abs(b) for a, b in zip(on_device, on_cpu, strict=True))
    return Check(
        "parity", "pass" if rel < 1e-3 else "fail", {"max_rel_diff": rel, "device": on_device}
    )


def _allocated(device: torch.device) -> int:
    return int(device_module(device).memory_allocated(device))


def check_tracer(device: str) -> Check:
    dev = torch.device(device)
    if not _caps(device).allocator_stats:
        return Check("tracer", NEEDS_ACCELERATOR, {})
    engine = _engine(device)
    samples: dict[int, int] = {}

    allowed: dict[int, int] = {}  # N_i as the engine reserved it (the carry included)

    def sample() -> None:
        m = engine.manager
        if m.tracer.following:
            i = m.tracer.moment
            chunks = m.residency.device_chunk_bytes()
            samples[i] = max(samples.get(i, 0), _allocated(dev) - chunks)
            allowed[i] = m.tracer.trace.need(i) + m.tracer.carry_bytes

    _train(engine, _batches(STEPS), sample)
    trace = engine.manager.tracer.trace
    over = [(i, s - allowed[i]) for i, s in samples.items() if s > allowed[i]]
    engine.close()
    return Check(
        "tracer",
        "pass" if samples and not over else "fail",
        {"moments_sampled": len(samples), "above_N_i": len(over), "peak_N": trace.peak_non_model},
        f"first above: moment {over[0][0]} by {over[0][1]} bytes" if over else "",
    )


def budgets(stats: dict[str, Any], device: str | torch.device) -> dict[str, int]:
    """The two device budgets the GPU checks train under, from the `stats()` of a run with
    no budget (N: its peak non-model bytes, P: its param chunks' bytes):
    - `params_evicted`: N + P/2, so params leave the device in forward and backward and
      no optimizer state fits (all Adam on the host);
    - `adam_split`: N + P, two chunks' optimizer triples (fp32 master, momentum, variance:
      12 bytes an element) and device Adam's temporary, so Adam runs on the device for
      some chunks and on the host for the others."""
    from pstar_core.kernels import adam_temporary_bytes

    chunk = stats["chunk_size"]
    n, p = stats["tracer"]["peak_non_model_bytes"], stats["chunks"]["param"]["bytes"]
    temporary = adam_temporary_bytes(chunk, torch.device(device))
    return {"params_evicted": int(n + 0.5 * p), "adam_split": n + p + 2 * 12 * chunk + temporary}


def probe_budgets(device: str, steps: int = 2) -> dict[str, int]:
    """`budgets` of the checks' model, measured by a run with no budget."""
    probe = _engine(device)
    _train(probe, _batches(steps))
    st = probe.stats()
    probe.close()
    return budgets(st, device)


@contextlib.contextmanager
def device_limited_to(device: str, budget: int) -> Iterator[dict[str, Any]]:
    """The device allowed what it holds now plus `budget / device_safety` (CUDA:
    `set_per_process_memory_fraction`), so an overrun is an out-of-memory error, not a
    number; yields the limit and, after the block, the reserved peak. No limit where the
    device has no allocator statistics (the CPU)."""
    dev = torch.device(device)
    numbers: dict[str, Any] = {"limit": None}
    if not _caps(device).allocator_stats:
        yield numbers
        return
    module = _module(device)
    # what an engine closed before left in the caching allocator is not this run's
    getattr(module, "empty_cache", lambda: None)()
    safety = pstar_core.config.MemoryConfig().device_safety
    limit = module.memory_reserved(dev) + int(budget / safety)
    _free, total = module.mem_get_info(dev)
    module.set_per_process_memory_fraction(min(1.0, limit / total), dev)
    module.reset_peak_memory_stats(dev)
    numbers["limit"] = limit
    try:
        yield numbers
    finally:
        numbers["reserved_peak"] = module.max_memory_reserved(dev)
        module.set_per_process_memory_fraction(1.0, dev)


def check_budget(device: str) -> Check:
    budget = probe_budgets(device)["params_evicted"]
    engine = None
    try:
        with device_limited_to(device, budget) as limited:
            engine = _engine(device, {"device_budget": budget})
            losses = _train(engine, _batches(STEPS))
    except torch.OutOfMemoryError as e:
        if engine is not None:
            engine.close()
        return Check(
            "budget", "fail", {"budget": budget, "limit": limited["limit"]}, f"out of memory: {e}"
        )
    moved = engine.stats()["bytes_moved"].get("device->host", 0)
    numbers: dict[str, Any] = {"budget": budget, "evicted_bytes": moved, "loss": losses[-1]}
    ok = moved > 0 and math.isfinite(losses[-1])
    if limited["limit"] is not None:
        numbers.update(reserved_peak=limited["reserved_peak"], limit=limited["limit"])
        ok = ok and limited["reserved_peak"] <= limited["limit"]
    else:
        peak = engine.manager.residency.tiers["device"].peak_bytes
        numbers["chunk_peak"] = peak
        ok = ok and peak <= budget
    engine.close()
    return Check("budget", "pass" if ok else "fail", numbers)


def check_mixed_adam(device: str) -> Check:
    """Room for every param chunk at the non-model peak and for two chunks' optimizer
    states (and Adam's temporary): placement puts some chunks' Adam on the device and
    leaves the rest on the host, so both kernels run in the same steps."""
    if not _caps(device).accelerator:
        return Check("mixed_adam", NEEDS_ACCELERATOR, {})
    budget = probe_budgets(device)["adam_split"]
    with device_limited_to(device, budget) as limited:
        engine = _engine(device, {"device_budget": budget})
        losses = _train(engine, _batches(STEPS))
    st = engine.stats()
    own = st["chunks"]["param"]["count"]
    engine.close()
    on_device = st["device_adam_chunks"]
    numbers = {
        "budget": budget,
        "device_adam_chunks": on_device,
        "own_chunks": own,
        "loss": losses[-1],
        **limited,
    }
    ok = 0 < on_device < own and all(math.isfinite(x) for x in losses)
    if limited["limit"] is not None:
        ok = ok and limited["reserved_peak"] <= limited["limit"]
    return Check("mixed_adam", "pass" if ok else "fail", numbers)


def check_pinned(device: str) -> Check:
    """Under a budget that keeps chunks on the host (N + P/2), every host chunk lies in
    the pool the engine registered and reads as pinned; none found no room there."""
    if not _caps(device).pinned_host:
        return Check("pinned", "skip (the device pins no host memory)", {})
    engine = _engine(device, {"device_budget": probe_budgets(device)["params_evicted"]})
    _train(engine, _batches(2))
    pool = engine.stats()["host_pool"]
    host = engine.manager.residency.tiers["host"]
    on_host = [c for c in engine.manager.chunks() if c.tier == "host" and c.payload is not None]
    outside = [f"{c.kind.value}.{c.index}" for c in on_host if not c.payload.is_pinned()]
    used, peak = host.used_bytes, host.peak_bytes
    engine.close()
    ok = pool is not None and pool["fallbacks"] == 0 and on_host and not outside
    return Check(
        "pinned",
        "pass" if ok else "fail",
        {
            **(pool or {}),
            "host_chunks": len(on_host),
            "outside_pool": len(outside),
            "host_used": used,
            "host_peak": peak,
        },
        "; ".join(outside[:3]),
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
        if "Memcpy HtoD" in e.name:
            copies.append(span)
        elif not e.name.startswith(("Memcpy", "Memset")):  # compute kernels only
            kernels.append(span)
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
    """Our device Adam (bf16 gradient read from the param slot, fp32 states, the new param
    cast back into the slot) against the same work in torch ops: 40 bytes per element in
    both (gradient 2 read, fp32 copy 4 written and read, master/momentum/variance 24, the
    master 4 read again and the param 2 written by the cast)."""
    from pstar_core.kernels import AdamSegment, adamw_

    dev = torch.device(device)
    accel = _caps(device).accelerator
    n = ADAM_ELEMS if accel else 1 << 22
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
    grad2 = grad.clone()
    views = [slice(s.offset, s.offset + s.numel) for s in segs]
    ms, vs = [m2[sl] for sl in views], [v2[sl] for sl in views]
    masters = [p2[sl] for sl in views]
    slots = [grad2[sl] for sl in views]
    steps = [torch.tensor(3.0, device=dev) for _ in segs]

    def reference() -> None:
        grads = [g.float() for g in slots]
        torch._fused_adamw_(
            masters, grads, ms, vs, [], steps, lr=1e-3, beta1=0.9, beta2=0.95,
            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
        torch._foreach_copy_(slots, masters)

    sync = (lambda: _module(device).synchronize(dev)) if accel else (lambda: None)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        return (time.perf_counter() - t0) / 5

    gb = n * 40 / 1e9
    ours_s, ref_s = [], []
    for _ in range(3):  # interleaved, medians
        ours_s.append(timed(ours))
        ref_s.append(timed(reference))
    ours_gbs, ref_gbs = gb / sorted(ours_s)[1], gb / sorted(ref_s)[1]
    ratio = ours_gbs / ref_gbs
    numbers = {
        "elements": n,
        "ours_GBps": round(ours_gbs, 1),
        "torch_ops_GBps": round(ref_gbs, 1),
        "ratio": round(ratio, 3),
    }
    if not accel:
        return Check("adam", "skip (CPU: the host kernel runs; numbers for reference)", numbers)
    if dev.type != "cuda":
        # the 0.8 bar is a GPU's memory bandwidth; on the test suite's fake device both
        # sides run on the CPU, and their ratio is its load's (it failed a loaded CI run)
        return Check("adam", "skip (not CUDA: the bar is a GPU's; numbers for reference)", numbers)
    return Check("adam", "pass" if ratio >= 0.8 else "fail", numbers)


def _nccl_worker(rank: int, world: int, tmp: str) -> None:  # pragma: no cover - CUDA only
    import datetime
    import json

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # the host's memory is shared by the ranks
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp}/pg",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=NCCL_SECONDS),
    )
    engine = _engine("cuda", dtype="fp32")
    data = [x.chunk(world)[rank] for x in _batches(STEPS, batch=4)]
    losses = _train(engine, data)
    t = torch.tensor(losses, device=f"cuda:{rank}")
    dist.all_reduce(t)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps((t / world).tolist()))
    dist.destroy_process_group()


NCCL_SECONDS = 90  # the two ranks' time limit (killed after it)


def check_nccl(device: str) -> Check:
    if torch.device(device).type != "cuda":
        return Check("nccl", CUDA_ONLY, {})
    if torch.cuda.device_count() < 2:  # pragma: no cover - CUDA only
        return Check("nccl", "skip (needs 2 GPUs)", {"gpus": torch.cuda.device_count()})
    import json  # pragma: no cover - CUDA only
    import subprocess  # pragma: no cover
    import sys  # pragma: no cover

    torch.backends.cuda.matmul.allow_tf32 = False  # pragma: no cover
    with _engine(device, dtype="fp32") as one:  # pragma: no cover
        single = _train(one, _batches(STEPS, batch=4))  # freed before the two ranks start
    code = (
        "import sys; from benchmarks.doctor import _nccl_worker as w; "
        "w(int(sys.argv[1]), 2, sys.argv[2])"
    )
    with tempfile.TemporaryDirectory() as tmp:  # pragma: no cover
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), tmp]) for r in range(2)]
        try:
            for p in procs:
                p.wait(timeout=NCCL_SECONDS)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return Check("nccl", "fail", {}, f"two NCCL ranks did not finish in {NCCL_SECONDS} s")
        if any(p.returncode for p in procs):
            return Check("nccl", "fail", {}, f"rank exit codes {[p.returncode for p in procs]}")
        two = json.loads(Path(tmp, "rank0.json").read_text())
    rel = max(abs(a - b) / abs(b) for a, b in zip(two, single, strict=True))  # pragma: no cover
    return Check(  # pragma: no cover
        "nccl", "pass" if rel < 1e-4 else "fail", {"max_rel_diff": rel, "two_ranks": two}
    )


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in this (the main) thread if the block runs past `seconds`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_sig: int, _frame: Any) -> None:
        raise TimeoutError(f"the check ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


CHECKS = (
    check_placement,
    check_parity,
    check_tracer,
    check_budget,
    check_mixed_adam,
    check_pinned,
    check_overlap,
    check_adam,
    check_nccl,
)


def run(
    device: str = "cuda", json_out: bool = False, only: Sequence[str] | None = None
) -> dict[str, Any]:
    """Run every check on `device` (or those named in `only`); the result (also printed as
    a table and JSON)."""
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
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "device": device,
        "capabilities": dataclasses.asdict(_caps(device)),
    }
    if torch.device(device).type == "cuda":  # pragma: no cover - CUDA only
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
    checks: list[Check] = []
    for fn in CHECKS:
        if only is not None and fn.__name__.removeprefix("check_") not in only:
            continue
        start = time.perf_counter()
        try:
            with _time_limit(CHECK_SECONDS):
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
