"""The acceptance run of the engine on one GPU, in at most 7 minutes.

    PYTHONPATH=. python scripts/gpu_check.py --out DIR                  # on the GPU machine
    PYTHONPATH=. python scripts/gpu_check.py --device fakegpu --out DIR # anywhere: CI runs it

It needs torch, numpy, safetensors, psutil, pyyaml and rich (a CUDA image has them) and
pydantic, which such an image may lack: it looks in `.gpu-deps/` (`--deps`), which
`bash scripts/gpu_deps.sh` fills on a machine with PyPI for the GPU machine's Python, and
says so before anything runs if pydantic is still missing. Nothing is installed.

Each stage runs in a process of its own under its own time limit (a hung CUDA call or
collective is killed, and the stage reports a timeout with its last output), and
`DIR/gpu_check.json` is written after every stage, so a run cut short still reports:

- env: torch, CUDA, NCCL, the GPU; which collective and stream names this torch has;
  pinned and pageable host<->device GB/s; page-locking (cudaHostRegister) GB/s; the host
  AdamW kernel built or not, and its choice against torch's fused AdamW;
- doctor: `pstar doctor --gpu`'s one-GPU checks (placement, parity, tracer against the
  allocator, overlap, device Adam), each within 60 s;
- budgets: a ~1B zoo GPT in bf16 under two device budgets, the device limited to each
  with `set_per_process_memory_fraction`: (a) N + P/2, params evicted to the pinned host
  in forward and backward, all Adam on the host; (b) N + P + room for two chunks'
  optimizer states, Adam split between device and host. Each: the moves, reserved peak
  against the limit, allocator retries, the tracer's N_i against the allocator sampled
  at every operator, the init peak per parameter, TFLOPS;
- baselines: the same model, data and seed as plain PyTorch (bf16 params, fp32 masters,
  fused AdamW on the GPU), as the engine with no budget, and as FSDP2 with CPU offload on
  one rank: TFLOPS and loss curves against plain PyTorch;
- resume: a checkpoint after step 2 and a fresh process that loads it: steps 3-4 bitwise,
  with Adam on the same chunks of each tier;
- nccl: every collective the engine calls, on one NCCL rank, with its dtypes and
  in-place buffers (a gloo flag group beside it).

On `--device fakegpu` (the test suite's second device) every stage executes on small
models and every figure a fake device cannot give (GB/s, TFLOPS, retries) says "n/a".
The last line printed is the whole result as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "doctor", "budgets", "baselines", "resume", "nccl")
# each stage's time limit in seconds: 7 minutes in all
LIMITS = {"env": 60, "doctor": 70, "budgets": 110, "baselines": 90, "resume": 55, "nccl": 35}
NEEDED = ("torch", "numpy", "safetensors", "psutil", "yaml", "rich", "pydantic")
NA = "n/a"
DEPS = ROOT / ".gpu-deps"  # where `scripts/gpu_deps.sh` unpacks what a GPU image lacks


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def add_deps(deps: Path) -> None:
    """Where a needed module is missing, put the unpacked wheels of `scripts/gpu_deps.sh`
    at the end of the path (what is installed comes first; each stage does the same)."""
    if missing_modules() and deps.is_dir() and str(deps) not in sys.path:
        sys.path.append(str(deps))


# ---------------------------------------------------------------------------------------
# What every stage shares: the device, the model, the data, the run loop
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models and batches of a run: real ones on a GPU, small ones on the fake device."""

    model: str  # a zoo name, or "small"
    seq: int
    batch: int
    resume_model: str
    warmup_steps: int = 2
    timed_steps: int = 5


GPU = Sizes(model="gpt-1b", seq=1024, batch=4, resume_model="gpt-100m")
SMALL = Sizes(model="small", seq=64, batch=4, resume_model="small")


def sizes_for(device: str) -> Sizes:
    return GPU if device.startswith("cuda") else SMALL


def gpt_config(name: str, seq: int):
    from pstar_core.models import GPTConfig, get_config

    if name == "small":
        return GPTConfig(hidden_size=128, num_layers=4, num_heads=4, vocab_size=1024, seq_len=seq)
    return dataclasses.replace(get_config(name), seq_len=seq)


def open_device(device: str):
    """Load the fake device when asked for; the torch.device of this process's GPU."""
    import torch

    if device.startswith("fakegpu"):
        from tests import fakedevice

        fakedevice.load()
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, 0)
    getattr(torch, dev.type).set_device(dev)
    return dev


def is_cuda(dev) -> bool:
    return dev.type == "cuda"


def gpu_only(dev, value: Any) -> Any:
    """A figure only a real GPU gives (speeds, CUDA's own counters), else "n/a"."""
    return value if is_cuda(dev) else NA


def sync(dev) -> None:
    import torch

    getattr(torch, dev.type).synchronize(dev)


def batches(cfg, sizes: Sizes, n: int, seed: int = 0) -> list:
    """Token batches on the host (the engine moves its inputs; the baselines move theirs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, cfg.vocab_size, (sizes.batch, sizes.seq), generator=g) for _ in range(n)
    ]


def flops_per_token(cfg, params: int) -> int:
    """Model FLOPs of one token in training (forward and backward, no recomputation):
    6 per parameter, plus attention's scores and mixing, 12 x layers x hidden x sequence."""
    return 6 * params + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_len


def vm_hwm() -> int | None:
    """Peak resident memory of this process (VmHWM), where /proc has it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_vm_hwm() -> bool:
    """Start VmHWM again from the resident memory now (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass
class Timed:
    """What a run of `warmup + timed` steps measured."""

    losses: list[float]
    step_s: list[float]  # each timed step, wall time with the device synchronized
    fwd_bwd_s: list[float]  # of which forward and backward
    moved_in_fwd_bwd: dict[str, int]  # the last timed step's moves before its step()

    def median(self, xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def tflops(self, per_token: int, tokens: int) -> float:
        return per_token * tokens / self.median(self.step_s) / 1e12


def timed_steps(
    data: list, dev, warmup: int, forward_backward: Callable[[Any], Any], step: Callable[[], None]
) -> Timed:
    """Train on `data`: the first `warmup` steps untimed, each other step timed with the
    device synchronized at its boundaries, forward+backward apart from the optimizer's
    `step`; `forward_backward(batch)` returns the loss."""
    out = Timed([], [], [], {})
    for i, x in enumerate(data):
        sync(dev)
        t0 = time.perf_counter()
        loss = forward_backward(x)
        sync(dev)
        t1 = time.perf_counter()
        step()
        sync(dev)
        t2 = time.perf_counter()
        out.losses.append(float(loss.detach()))
        if i >= warmup:
            out.step_s.append(t2 - t0)
            out.fwd_bwd_s.append(t1 - t0)
    return out


def run_engine(engine, data: list, dev, warmup: int) -> Timed:
    """`timed_steps` of the engine (which moves each batch to its device itself), with the
    moves of the last step's forward and backward."""
    moved: dict[str, int] = {}

    def forward_backward(x):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        moved.clear()
        moved.update(engine.manager.residency.transfers.iteration_bytes_moved)
        return loss

    out = timed_steps(data, dev, warmup, forward_backward, engine.step)
    out.moved_in_fwd_bwd = moved
    return out


def engine_config(device: str, memory: dict | None = None, **extra: Any) -> dict:
    return {
        "dtype": "bf16",
        "device": device,
        "chunk_size": "auto",
        "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
        "memory": memory or {},
        **extra,
    }


@dataclasses.dataclass
class Result:
    status: str  # "pass", "fail"
    numbers: dict[str, Any]
    detail: str = ""


# ---------------------------------------------------------------------------------------
# Stage: env
# ---------------------------------------------------------------------------------------


def _gbps(nbytes: int, fn: Callable[[], None], dev, reps: int = 3) -> float:
    fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def _copy_speeds(dev) -> dict[str, Any]:
    """Host <-> device copies of 1 GiB on a GPU, from pinned and from pageable memory."""
    import torch

    from pstar_core.devices import capabilities

    n = (1 << 30) if is_cuda(dev) else (16 << 20)
    on_dev = torch.empty(n, dtype=torch.uint8, device=dev)
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=capabilities(dev).pinned_host)
    copies = {
        "h2d_pinned_GBps": lambda: on_dev.copy_(pinned, non_blocking=True),
        "d2h_pinned_GBps": lambda: pinned.copy_(on_dev, non_blocking=True),
        "h2d_pageable_GBps": lambda: on_dev.copy_(pageable),
        "d2h_pageable_GBps": lambda: pageable.copy_(on_dev),
    }
    return {name: gpu_only(dev, round(_gbps(n, fn, dev), 2)) for name, fn in copies.items()}


def _nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def stage_env(device: str, dev) -> Result:
    import inspect

    import torch
    import torch.distributed as dist

    from pstar_core.devices import capabilities, register_host, unregister_host
    from pstar_core.kernels import adam

    numbers: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capabilities": dataclasses.asdict(capabilities(dev)),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if is_cuda(dev):
        props = torch.cuda.get_device_properties(dev)
        numbers.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            compute_capability=f"{props.major}.{props.minor}",
            nccl=_nccl_version(),
            bf16=torch.cuda.is_bf16_supported(),
        )
    numbers["api"] = {
        "dist.all_gather_single": hasattr(dist, "all_gather_single"),
        "dist.reduce_scatter_single": hasattr(dist, "reduce_scatter_single"),
        "dist.all_gather_into_tensor": hasattr(dist, "all_gather_into_tensor"),
        "dist.reduce_scatter_tensor": hasattr(dist, "reduce_scatter_tensor"),
        "new_group(use_local_synchronization)": "use_local_synchronization"
        in inspect.signature(dist.new_group).parameters,
        "torch.accelerator.set_stream": hasattr(torch.accelerator, "set_stream"),
        "torch.Event": hasattr(torch, "Event"),
        "torch.Stream as context manager": hasattr(torch.Stream, "__enter__"),
        "fsdp.fully_shard": importlib.util.find_spec("torch.distributed.fsdp") is not None
        and hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"),
    }
    numbers.update(_copy_speeds(dev))
    # page-locking ordinary memory, as the engine's host pool does: 8 GiB on a GPU
    import mmap

    n = (8 << 30) if is_cuda(dev) else (64 << 20)
    buffer = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
    t0 = time.perf_counter()
    register_host(dev, buffer)
    seconds = time.perf_counter() - t0
    unregister_host(dev, buffer)
    del buffer
    numbers["host_register_GBps"] = gpu_only(dev, round(n / seconds / 1e9, 2))
    # the host AdamW kernel: built here (g++, ninja, the Python headers) or not
    t0 = time.perf_counter()
    prepared = adam.prepare([torch.get_num_threads()])
    numbers["adam_kernel"] = {
        "built": prepared["built"],
        "build_s": round(prepared["build_s"], 1),
        "choices": {k: v["backend"] for k, v in prepared["choices"].items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    ok = (
        numbers["api"]["dist.all_gather_into_tensor"]
        and numbers["api"]["torch.accelerator.set_stream"]
    )
    return Result("pass" if ok else "fail", numbers, "" if ok else "torch lacks a name we need")


# ---------------------------------------------------------------------------------------
# Stage: doctor
# ---------------------------------------------------------------------------------------


def stage_doctor(device: str, dev) -> Result:
    from benchmarks import doctor
    from pstar_core.models import get_config

    if not is_cuda(dev):  # the doctor's model is sized for a GPU: the test's sizes here
        doctor.MODEL = dataclasses.replace(get_config("gpt-tiny"), vocab_size=256)
        doctor.SEQ, doctor.CHUNK, doctor.ADAM_ELEMS = 32, 1 << 14, 1 << 20
    only = ("placement", "parity", "tracer", "overlap", "adam")
    result = doctor.run(device=str(dev), only=only)
    checks = result["checks"]
    failed = [name for name, c in checks.items() if c["status"] == "fail"]
    status = "fail" if failed else "pass"
    return Result(status, {"checks": checks}, f"failed: {failed}" if failed else "")


# ---------------------------------------------------------------------------------------
# Stage: budgets
# ---------------------------------------------------------------------------------------


def _sampled_against_trace(engine, dev) -> tuple[dict[int, int], Callable[[], int]]:
    """An observer of Access sampling the allocator's non-chunk bytes at every operator
    of a traced iteration; returns the samples and a counter of those above N_i."""
    from pstar_core.devices import device_module

    m = engine.manager
    samples: dict[int, int] = {}
    allowed: dict[int, int] = {}

    def observe(_slots) -> None:
        if m.tracer.following:
            i = m.tracer.moment
            chunks = m.residency.tiers["device"].used_bytes
            allocated = int(device_module(dev).memory_allocated(dev))
            samples[i] = max(samples.get(i, 0), allocated - chunks)
            allowed[i] = m.tracer.trace.non_model[i] + m.tracer.carry_bytes

    m.on_access.append(observe)
    return samples, lambda: sum(1 for i, s in samples.items() if s > allowed[i])


def _budget_run(name: str, device: str, dev, sizes: Sizes, budget: int, cfg) -> dict[str, Any]:
    import torch

    import pstar_core
    from benchmarks.doctor import device_limited_to
    from pstar_core.models import build, num_params

    data = batches(cfg, sizes, sizes.warmup_steps + sizes.timed_steps)
    params = num_params(cfg)
    with device_limited_to(str(dev), budget) as limited:
        torch.manual_seed(0)
        reset = reset_vm_hwm()
        before = vm_hwm()
        engine = pstar_core.initialize(
            lambda: build(cfg), engine_config(device, {"device_budget": budget})
        )
        after = vm_hwm()
        samples, above = _sampled_against_trace(engine, dev)
        timed = run_engine(engine, data, dev, sizes.warmup_steps)
    st = engine.stats()
    m = engine.manager
    host_chunks = [c for c in m.chunks() if c.tier == "host" and c.payload is not None]
    unpinned = sum(1 for c in host_chunks if not c.payload.is_pinned())
    retries = None
    if is_cuda(dev):
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
    engine.close()
    per_token = flops_per_token(cfg, params)
    tokens = sizes.batch * sizes.seq
    init_peak = (after - before) if reset and before is not None and after is not None else None
    return {
        "budget": budget,
        **limited,
        "losses": [round(x, 4) for x in timed.losses],
        "finite": all(math.isfinite(x) for x in timed.losses),
        "evicted_in_fwd_bwd": timed.moved_in_fwd_bwd.get("device->host", 0),
        "fetched_in_fwd_bwd": timed.moved_in_fwd_bwd.get("host->device", 0),
        "device_adam_chunks": st["device_adam_chunks"],
        "own_chunks": st["chunks"]["param"]["count"],
        "host_pool": st["host_pool"],
        "host_chunks_unpinned": unpinned,
        "alloc_retries": gpu_only(dev, retries),
        "moments_sampled": len(samples),
        "sampled_above_N_i": above(),
        "init_peak_bytes_per_param": round(init_peak / params, 2) if init_peak else None,
        "step_s": round(timed.median(timed.step_s), 4),
        "fwd_bwd_s": round(timed.median(timed.fwd_bwd_s), 4),
        "tflops": gpu_only(dev, round(timed.tflops(per_token, tokens), 1)),
        "prefetched": st["prefetched"],
        "name": name,
    }


def stage_budgets(device: str, dev) -> Result:
    import torch

    import pstar_core
    from pstar_core.kernels import adam_temporary_bytes
    from pstar_core.models import build, num_params

    sizes = sizes_for(device)
    cfg = gpt_config(sizes.model, sizes.seq)
    torch.manual_seed(0)
    probe = pstar_core.initialize(lambda: build(cfg), engine_config(device))
    run_engine(probe, batches(cfg, sizes, 2), dev, warmup=2)
    st = probe.stats()
    probe.close()
    n, p = st["tracer"]["peak_non_model_bytes"], st["chunks"]["param"]["bytes"]
    chunk = st["chunk_size"]
    triple, temporary = 12 * chunk, adam_temporary_bytes(chunk, dev)
    runs = {
        "a_params_evicted": _budget_run("a", device, dev, sizes, int(n + 0.5 * p), cfg),
        "b_adam_split": _budget_run("b", device, dev, sizes, n + p + 2 * triple + temporary, cfg),
    }
    a, b = runs["a_params_evicted"], runs["b_adam_split"]
    problems = []
    for key, r in runs.items():
        if not r["finite"]:
            problems.append(f"{key}: a loss is not finite")
        if r["limit"] is not None and r["reserved_peak"] > r["limit"]:
            problems.append(f"{key}: reserved {r['reserved_peak']} > limit {r['limit']}")
        if r["alloc_retries"] not in (0, NA):
            problems.append(f"{key}: {r['alloc_retries']} allocator retries")
        if r["sampled_above_N_i"]:
            problems.append(f"{key}: the allocator was above N_i at {r['sampled_above_N_i']}")
        if r["host_pool"] is None or r["host_pool"]["fallbacks"] or r["host_chunks_unpinned"]:
            problems.append(f"{key}: host chunks outside the pinned pool")
    if not a["evicted_in_fwd_bwd"]:
        problems.append("a: no chunk left the device during forward and backward")
    if not 0 < b["device_adam_chunks"] < b["own_chunks"]:
        problems.append(f"b: Adam on the device for {b['device_adam_chunks']} chunks")
    numbers = {
        "model": sizes.model,
        "params": num_params(cfg),
        "non_model_peak": n,
        "param_chunk_bytes": p,
        "chunk_size": chunk,
        **runs,
    }
    return Result("fail" if problems else "pass", numbers, "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Stage: baselines
# ---------------------------------------------------------------------------------------


def _torch_loop(model, data: list, dev, warmup: int, step: Callable[[], None]) -> Timed:
    """`timed_steps` of a plain PyTorch model (its batches moved to the device here)."""

    def forward_backward(x):
        x = x.to(dev)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss

    return timed_steps(data, dev, warmup, forward_backward, step)


def _plain_torch(model, data: list, dev, warmup: int) -> Timed:
    """bf16 params and compute, fp32 masters, torch's fused AdamW, all on the device."""
    import torch

    model = model.to(dev)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

    def step() -> None:
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)

    return _torch_loop(model, data, dev, warmup, step)


def _fsdp2_offload(model, data: list, dev, warmup: int) -> Timed:
    """FSDP2 on one rank: bf16 compute with fp32 reduction, parameters and the optimizer
    offloaded to pinned host memory (torch AdamW on the CPU)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(dev.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError):  # a torch without the CPU fused AdamW
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _torch_loop(model, data, dev, warmup, step)


def _init_single_rank(dev) -> None:
    import torch.distributed as dist

    backend = "nccl" if is_cuda(dev) else f"cpu:gloo,{dev.type}:fakenccl"
    store = Path(tempfile.mkdtemp(prefix="pstar-gpu-check-")) / "pg"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


LOSS_RTOL = 2e-2  # bf16 runs of the same model, data and seed: curves within 2 %


def stage_baselines(device: str, dev) -> Result:
    import torch
    import torch.distributed as dist

    import pstar_core
    from pstar_core.models import build, num_params

    sizes = sizes_for(device)
    cfg = gpt_config(sizes.model, sizes.seq)
    data = batches(cfg, sizes, sizes.warmup_steps + sizes.timed_steps)
    per_token, tokens = flops_per_token(cfg, num_params(cfg)), sizes.batch * sizes.seq

    torch.manual_seed(0)
    reference = build(cfg)  # one random init, on the host; copies keep its tied weights

    def copy_on(where):
        return copy.deepcopy(reference).to(where)

    runs: dict[str, Timed] = {}
    runs["plain_torch"] = _plain_torch(copy_on(dev), data, dev, sizes.warmup_steps)
    if is_cuda(dev):
        torch.cuda.empty_cache()  # plain PyTorch's blocks go back before the engine plans
    engine = pstar_core.initialize(lambda: build(cfg), engine_config(device))
    engine.load_state_dict(reference.state_dict())
    runs["engine_no_budget"] = run_engine(engine, data, dev, sizes.warmup_steps)
    device_adam = engine.stats()["device_adam_chunks"]
    engine.close()
    _init_single_rank(dev)
    try:
        runs["fsdp2_cpu_offload"] = _fsdp2_offload(copy_on("cpu"), data, dev, sizes.warmup_steps)
    finally:
        dist.destroy_process_group()
    plain = runs["plain_torch"]
    numbers: dict[str, Any] = {"model": sizes.model, "tokens_per_step": tokens}
    problems = []
    for name, r in runs.items():
        rel = max(abs(a - b) / abs(b) for a, b in zip(r.losses, plain.losses, strict=True))
        numbers[name] = {
            "losses": [round(x, 4) for x in r.losses],
            "max_rel_loss_diff_vs_plain": round(rel, 5),
            "step_s": round(r.median(r.step_s), 4),
            "fwd_bwd_s": round(r.median(r.fwd_bwd_s), 4),
            "tflops": gpu_only(dev, round(r.tflops(per_token, tokens), 1)),
            "step_time_vs_plain": round(r.median(r.step_s) / plain.median(plain.step_s), 3),
        }
        if rel > LOSS_RTOL or not all(math.isfinite(x) for x in r.losses):
            problems.append(f"{name}: losses {rel:.3g} from plain PyTorch's (allowed {LOSS_RTOL})")
    numbers["engine_no_budget"]["device_adam_chunks"] = device_adam
    return Result("fail" if problems else "pass", numbers, "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Stage: resume
# ---------------------------------------------------------------------------------------


def _resume_half(device: str, half: str, work: Path) -> None:
    """One process of the resume stage: "a" trains 4 steps and checkpoints after step 2,
    "b" loads that checkpoint and trains steps 3-4. Each writes what it saw."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = open_device(device)
    if is_cuda(dev):  # attention's plain path: the fused kernels' backward may use atomics
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    import pstar_core
    from pstar_core.chunk import ChunkType
    from pstar_core.kernels import adam_temporary_bytes
    from pstar_core.models import build

    sizes = sizes_for(device)
    cfg = gpt_config(sizes.resume_model, sizes.seq)
    data = batches(cfg, sizes, 4, seed=1)
    if half == "a":  # a budget with Adam on both tiers: the probe's sizes, as in budgets
        torch.manual_seed(0)
        probe = pstar_core.initialize(lambda: build(cfg), engine_config(device))
        run_engine(probe, data[:2], dev, warmup=2)
        st = probe.stats()
        probe.close()
        chunk = st["chunk_size"]
        budget = st["tracer"]["peak_non_model_bytes"] + st["chunks"]["param"]["bytes"]
        budget += 24 * chunk + adam_temporary_bytes(chunk, dev)
        (work / "budget.json").write_text(json.dumps(budget))
    budget = json.loads((work / "budget.json").read_text())
    torch.manual_seed(0)
    engine = pstar_core.initialize(
        lambda: build(cfg), engine_config(device, {"device_budget": budget})
    )
    if half == "a":
        first = run_engine(engine, data[:2], dev, warmup=2).losses
        engine.save_checkpoint(work / "ckpt")
    else:
        engine.load_checkpoint(work / "ckpt")
        first = []
    device_adam = sorted(engine.manager.device_adam)
    last = run_engine(engine, data[2:], dev, warmup=2).losses
    m = engine.manager
    digest = hashlib.sha256()
    for kind in (ChunkType.PARAM_FP32, ChunkType.MOMENTUM, ChunkType.VARIANCE):
        for c in m.lists[kind]:
            digest.update(m.residency.in_memory(c).payload.cpu().view(torch.uint8).numpy())
    for name, t in sorted(engine.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.contiguous().view(torch.uint8).numpy())
    result = {
        "first": first,
        "last": last,
        "device_adam_before_step_3": device_adam,
        "own_chunks": len(m.lists[ChunkType.PARAM]),
        "state_sha256": digest.hexdigest(),
        "budget": budget,
    }
    engine.close()
    (work / f"{half}.json").write_text(json.dumps(result))


def stage_resume(device: str, dev) -> Result:
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # before CUDA starts: deterministic cuBLAS
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="pstar-resume-") as tmp:
        for half in ("a", "b"):
            cmd = [sys.executable, __file__, "--device", device, "--resume-half", half, tmp]
            proc = subprocess.run(
                [*cmd, "--deps", str(DEPS)],
                env=env,
                capture_output=True,
                text=True,
                timeout=LIMITS["resume"],
            )
            if proc.returncode != 0:
                return Result("fail", {}, f"half {half}: {(proc.stdout + proc.stderr)[-1500:]}")
            results[half] = json.loads(Path(tmp, f"{half}.json").read_text())
    a, b = results["a"], results["b"]
    numbers = {
        "losses_straight": a["last"],
        "losses_resumed": b["last"],
        "same_state": a["state_sha256"] == b["state_sha256"],
        "device_adam_chunks": len(a["device_adam_before_step_3"]),
        "own_chunks": a["own_chunks"],
        "same_device_adam": a["device_adam_before_step_3"] == b["device_adam_before_step_3"],
    }
    problems = []
    if a["last"] != b["last"]:
        problems.append("steps 3-4 differ after resuming")
    if not numbers["same_state"]:
        problems.append("the chunks or the state dict differ after step 4")
    if not numbers["same_device_adam"]:
        problems.append("the resumed run's first step ran Adam on other chunks")
    if not 0 < numbers["device_adam_chunks"] < numbers["own_chunks"]:
        problems.append("Adam did not run on both tiers")
    return Result("fail" if problems else "pass", numbers, "; ".join(problems))


# ---------------------------------------------------------------------------------------
# Stage: nccl
# ---------------------------------------------------------------------------------------


def stage_nccl(device: str, dev) -> Result:
    """Every collective the engine issues, as it issues it, on one rank: the single-buffer
    gather and reduce-scatter in place on bf16, the int64 and float64 all-reduces, a
    broadcast, a barrier, and the gloo flag group (with local synchronization) beside."""
    import torch
    import torch.distributed as dist

    from pstar_core import zero

    numbers: dict[str, Any] = {}
    if is_cuda(dev):
        numbers["nccl"] = _nccl_version()
    _init_single_rank(dev)
    probes: dict[str, str] = {}

    def probe(name: str, fn: Callable[[], bool]) -> None:
        try:
            probes[name] = "ok" if fn() else "wrong result"
        except Exception as e:  # each probe reports its own failure
            probes[name] = f"{type(e).__name__}: {str(e)[:200]}"

    n = 1 << 20
    values = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)

    def gather() -> bool:
        buffer = values.to(dev)
        zero._gather_into(buffer, buffer[:n], None)
        sync(dev)
        return torch.equal(buffer.cpu(), values)

    def reduce_scatter() -> bool:  # in place: the output is the rank's slice of the input
        buffer = values.to(dev)
        zero._reduce_scatter_into(buffer[:n], buffer, None, async_op=True).wait()
        sync(dev)
        return torch.equal(buffer.cpu(), values)

    def all_reduce(dtype: torch.dtype, op) -> Callable[[], bool]:
        def run() -> bool:
            t = torch.tensor([3], dtype=dtype, device=dev)
            dist.all_reduce(t, op=op)
            return int(t.item()) == 3

        return run

    def broadcast() -> bool:
        t = torch.full((16,), 7.0, device=dev)
        dist.broadcast(t, src=0)
        return bool((t == 7).all())

    def flags(**local: bool) -> Callable[[], bool]:
        def run() -> bool:
            ranks = [0] if local else None
            group = dist.new_group(ranks=ranks, backend="gloo", **local)
            flag = torch.tensor([0, 1, 2, 3, 4, -1, -2, -3, -4], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            return flag.tolist() == [0, 1, 2, 3, 4, -1, -2, -3, -4]

        return run

    try:
        probe("all_gather in place, bf16", gather)
        probe("reduce_scatter in place, async, bf16", reduce_scatter)
        probe("all_reduce int64 MAX", all_reduce(torch.int64, dist.ReduceOp.MAX))
        probe("all_reduce float64 SUM", all_reduce(torch.float64, dist.ReduceOp.SUM))
        probe("broadcast fp32", broadcast)
        probe("barrier", lambda: dist.barrier() is None)
        probe("gloo flag group", flags())
        probe(
            "gloo flag group of a subgroup, local synchronization",
            flags(use_local_synchronization=True),
        )
    finally:
        dist.destroy_process_group()
    numbers["probes"] = probes
    bad = [k for k, v in probes.items() if v != "ok"]
    return Result("fail" if bad else "pass", numbers, "; ".join(f"{k}: {probes[k]}" for k in bad))


STAGE_FUNCTIONS: dict[str, Callable[[str, Any], Result]] = {
    "env": stage_env,
    "doctor": stage_doctor,
    "budgets": stage_budgets,
    "baselines": stage_baselines,
    "resume": stage_resume,
    "nccl": stage_nccl,
}


def run_stage(name: str, device: str, out: Path) -> None:
    """The child side: run one stage and write its result (a crash is a failed stage)."""
    start = time.perf_counter()
    try:
        dev = open_device(device)
        result = STAGE_FUNCTIONS[name](device, dev)
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        result = Result("fail", {}, f"{type(e).__name__}: {e} at {tb[-4:]}")
    payload = {
        "status": result.status,
        "seconds": round(time.perf_counter() - start, 1),
        "numbers": result.numbers,
        "detail": result.detail,
    }
    (out / "stages").mkdir(parents=True, exist_ok=True)
    (out / "stages" / f"{name}.json").write_text(json.dumps(payload, default=str))


# ---------------------------------------------------------------------------------------
# The parent: stages in order, each in its own process under its own limit
# ---------------------------------------------------------------------------------------


def _tail(text: str | bytes | None, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def run_all(
    device: str,
    out: Path,
    stages: list[str],
    print_table: bool = True,
    deps: Path = ROOT / ".gpu-deps",
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "stages": {}, "started": time.time()}
    path = out / "gpu_check.json"
    t0 = time.perf_counter()
    for name in stages:
        started = time.perf_counter()
        stage_file = out / "stages" / f"{name}.json"
        stage_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--device", device, "--out", str(out), "--stage", name]
        cmd += ["--deps", str(deps)]
        print(f"gpu_check: {name} (limit {LIMITS[name]} s) ...", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS[name])
            output = proc.stdout + proc.stderr
            if stage_file.is_file():
                entry = json.loads(stage_file.read_text())
            else:
                entry = {"status": "fail", "numbers": {}, "detail": f"exit {proc.returncode}"}
            if entry["status"] == "fail":
                entry["output_tail"] = _tail(output)
        except subprocess.TimeoutExpired as e:
            entry = {
                "status": "timeout",
                "numbers": {},
                "detail": f"killed after its {LIMITS[name]} s limit",
                "output_tail": _tail(e.stdout) + _tail(e.stderr),
            }
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        report["stages"][name] = entry
        report["passed"] = [k for k, v in report["stages"].items() if v["status"] == "pass"]
        report["failed"] = [k for k, v in report["stages"].items() if v["status"] != "pass"]
        report["seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"gpu_check: {name}: {entry['status']} in {entry['wall_s']} s", file=sys.stderr)
    report["throughput"] = throughput_table(report)
    path.write_text(json.dumps(report, indent=1, default=str))
    if print_table:
        show(report)
    return report


def throughput_table(report: dict) -> list[dict[str, Any]]:
    """TFLOPS of every configuration measured, and each step time against plain PyTorch."""
    rows = []
    base = report["stages"].get("baselines", {}).get("numbers", {})
    plain = base.get("plain_torch", {}).get("step_s")
    for key in ("plain_torch", "engine_no_budget", "fsdp2_cpu_offload"):
        if key in base:
            rows.append({"run": key, "tflops": base[key]["tflops"], "step_s": base[key]["step_s"]})
    budgets = report["stages"].get("budgets", {}).get("numbers", {})
    for key in ("a_params_evicted", "b_adam_split"):
        if key in budgets:
            rows.append(
                {
                    "run": f"engine {key}",
                    "tflops": budgets[key]["tflops"],
                    "step_s": budgets[key]["step_s"],
                }
            )
    for r in rows:
        r["step_time_vs_plain"] = round(r["step_s"] / plain, 3) if plain else None
    return rows


def show(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    table = Table(title=f"gpu_check on {report['device']}")
    for col in ("stage", "status", "seconds", "detail"):
        table.add_column(col)
    for name, s in report["stages"].items():
        style = "green" if s["status"] == "pass" else "red"
        table.add_row(name, f"[{style}]{s['status']}", str(s["wall_s"]), s.get("detail", "")[:120])
    console.print(table)
    if report["throughput"]:
        t = Table(title="throughput (model FLOPs, median step)")
        for col in ("run", "TFLOPS", "step s", "step time / plain PyTorch's"):
            t.add_column(col)
        for r in report["throughput"]:
            t.add_row(r["run"], str(r["tflops"]), str(r["step_s"]), str(r["step_time_vs_plain"]))
        console.print(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/gpu-check"), help="where gpu_check.json goes"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or fakegpu")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    parser.add_argument(
        "--deps",
        type=Path,
        default=ROOT / ".gpu-deps",
        help="unpacked wheels of what this machine lacks (scripts/gpu_deps.sh)",
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child running one stage
    parser.add_argument("--resume-half", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEPS
    DEPS = args.deps
    add_deps(args.deps)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if args.resume_half:
        _resume_half(args.device, args.resume_half[0], Path(args.resume_half[1]))
        return 0
    if args.stage:
        run_stage(args.stage, args.device, args.out)
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    missing = missing_modules()
    if missing:
        error = (
            f"missing Python modules: {', '.join(missing)}. On a machine with PyPI run "
            f"`bash scripts/gpu_deps.sh PYTHON_VERSION` (this one's is "
            f"{sys.version_info.major}.{sys.version_info.minor}): it unpacks them into "
            f"{args.deps}, which this script puts on the path; copy that folder here"
        )
        print(error, file=sys.stderr)
        print(json.dumps({"device": args.device, "error": error, "missing": missing}))
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            error = "torch sees no CUDA device (a CPU build of torch, or no GPU visible)"
            print(error, file=sys.stderr)
            print(json.dumps({"device": args.device, "error": error}))
            return 2
    report = run_all(args.device, args.out, stages, deps=args.deps)
    print(json.dumps(report, default=str, separators=(",", ":")))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
