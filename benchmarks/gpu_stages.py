"""The stages of the one-GPU acceptance run (`scripts/gpu_check.py`, which runs each in a
process of its own under its own time limit and writes the report; see its docstring for
what each stage does and what its numbers mean).

Every stage is `stage_NAME(device, dev) -> Result`, `STAGE_FUNCTIONS` names them; only
the stages' own processes import this module (the script's parent never loads torch). On
a GPU the models are real (`gpu_common.GPU`: a ~1B GPT); on the test suite's fake device
they are small (`SMALL`), and figures only a GPU gives say "n/a". What the stages share
is in `benchmarks/gpu_common.py`; the resume stage is `benchmarks/gpu_resume.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.doctor import budgets
from benchmarks.gpu_common import (
    NA,
    Result,
    Sizes,
    Timed,
    batches,
    engine_config,
    flops_per_token,
    gpt_config,
    gpu_only,
    init_single_rank,
    is_cuda,
    probe,
    reset_vm_hwm,
    run_engine,
    sizes_for,
    sync,
    timed_steps,
    vm_hwm,
)
from benchmarks.gpu_profile import stage_profile
from benchmarks.gpu_resume import stage_resume

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
            chunks = m.residency.device_chunk_bytes()
            allocated = int(device_module(dev).memory_allocated(dev))
            samples[i] = max(samples.get(i, 0), allocated - chunks)
            allowed[i] = m.tracer.trace.need(i) + m.tracer.carry_bytes

    m.on_access.append(observe)
    return samples, lambda: sum(1 for i, s in samples.items() if s > allowed[i])


# how far the losses of (a) with Adam beside backward may be from (a)'s on a GPU, relative
BESIDE_REL_DIFF = 1e-4


# the beside run's own comparison: blocks of steps each way, alternated in one process
ALTERNATED_BLOCKS, ALTERNATED_BLOCK_STEPS = 3, 3


def _alternated(engine, data: list, dev) -> dict[str, Any]:
    """Steps of one engine in blocks, backward then step and `backward_and_step` by turns
    (`ALTERNATED_BLOCKS` of each), the first step of each block untimed (it pays for how
    the last block left the chunks): the medians of each way and their ratio. Runs in
    separate processes varied more than the gain on an H200 (docs/gpu.md)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    k = 0
    for _ in range(ALTERNATED_BLOCKS):
        for beside in (False, True):
            batch = [data[(k + j) % len(data)] for j in range(ALTERNATED_BLOCK_STEPS)]
            k += ALTERNATED_BLOCK_STEPS
            times[beside] += run_engine(engine, batch, dev, 1, beside).step_s
    plain, beside_s = statistics.median(times[False]), statistics.median(times[True])
    return {
        "plain_step_s": round(plain, 4),
        "beside_step_s": round(beside_s, 4),
        "speedup": round(plain / beside_s, 3),
        "steps_each": len(times[True]),
    }


def _budget_run(
    name: str, device: str, dev, sizes: Sizes, budget: int, cfg, beside: bool = False
) -> dict[str, Any]:
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
        timed = run_engine(engine, data, dev, sizes.warmup_steps, beside)
        alternated = _alternated(engine, data, dev) if beside else None
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
        "adam_beside_backward_chunks": st["adam_beside_backward_chunks"],
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
        **({"alternated": alternated} if alternated else {}),
        "name": name,
    }


def stage_budgets(device: str, dev) -> Result:
    from pstar_core.models import num_params

    sizes = sizes_for(device)
    cfg = gpt_config(sizes.model, sizes.seq)
    st = probe(cfg, batches(cfg, sizes, 2), device, dev)
    two = budgets(st, dev)
    runs = {
        "a_params_evicted": _budget_run("a", device, dev, sizes, two["params_evicted"], cfg),
        "b_adam_split": _budget_run("b", device, dev, sizes, two["adam_split"], cfg),
        # (a) again with backward_and_step: host Adam beside backward, the same numbers
        "a_adam_beside": _budget_run(
            "a_beside", device, dev, sizes, two["params_evicted"], cfg, beside=True
        ),
    }
    a, b, beside = runs["a_params_evicted"], runs["b_adam_split"], runs["a_adam_beside"]
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
    # bitwise where the kernels are deterministic (the fake device; on a GPU the resume
    # stage's "c" checks it); here the attention torch picks may not be (cuDNN's backward
    # on an H200, which the resume stage turns off): 9e-6 relative at step 5 of 7 there
    differs = max(abs(x - y) / abs(y) for x, y in zip(beside["losses"], a["losses"], strict=True))
    if differs > (BESIDE_REL_DIFF if is_cuda(dev) else 0.0):
        problems.append(
            f"a with Adam beside backward: losses differ from backward, then step ({differs:.1e})"
        )
    beside["max_rel_loss_diff"] = differs
    if not beside["adam_beside_backward_chunks"]:
        problems.append("a with Adam beside backward: no chunk's Adam ran beside backward")
    numbers = {
        "model": sizes.model,
        "params": num_params(cfg),
        "non_model_peak": st["tracer"]["peak_non_model_bytes"],
        "param_chunk_bytes": st["chunks"]["param"]["bytes"],
        "chunk_size": st["chunk_size"],
        # (a)'s step with Adam after backward over its step with Adam beside it
        "beside_speedup": round(a["step_s"] / beside["step_s"], 3) if beside["step_s"] else None,
        # the same within the beside run's process, blocks of each way alternated
        "beside_speedup_alternated": beside["alternated"]["speedup"],
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
    init_single_rank(dev)
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
    init_single_rank(dev)
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
    "profile": stage_profile,  # opt-in: not in gpu_check's default stages
}
