"""The acceptance run's opt-in `profile` stage (`scripts/gpu_check.py --stages profile`):
where an engine step's time goes on this device, for the model and batch of the other
stages, under N + P/2 (params evicted, all Adam on the host), with backward then step
and with `backward_and_step` (host Adam beside backward).

For each: the host's Python by function (cProfile over one step: which of the engine's
own calls cost the most), and one more step under `torch.profiler` (the device's busy
time against the step's wall time, the kernels and copies that took it, and the host
operators that spent the most of their own time). A step whose device is busy for a small
part of its wall time is waiting on the host (Python overhead, a synchronization) or on
copies the trace did not hide."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from typing import Any

from benchmarks.doctor import budgets
from benchmarks.gpu_common import (
    Result,
    batches,
    engine_config,
    gpt_config,
    is_cuda,
    probe,
    sizes_for,
    sync,
)

TOP = 25
TABLE = {"row_limit": TOP, "max_name_column_width": 60}


def _train_step(engine, x, beside: bool) -> None:
    loss = engine(input_ids=x, labels=x).loss
    if beside:  # host Adam beside backward
        engine.backward_and_step(loss)
    else:
        engine.backward(loss)
        engine.step()


def _host_profile(engine, x, dev, beside: bool) -> tuple[float, list[str]]:
    """One step under cProfile: its wall time and the functions with most time of their
    own, then with most below them (this thread's only: on a GPU, autograd runs backward's
    hooks on a thread of its own, which `top_host` covers)."""
    prof = cProfile.Profile()
    sync(dev)
    t0 = time.perf_counter()
    prof.enable()
    _train_step(engine, x, beside)
    sync(dev)
    prof.disable()
    wall = time.perf_counter() - t0
    lines = []
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(TOP)
        lines += [ln.rstrip() for ln in text.getvalue().splitlines() if ln.strip()][-TOP - 1 :]
    return wall, lines


def _device_profile(engine, x, dev, beside: bool) -> dict[str, Any]:
    """One step under torch.profiler: wall time, the device's busy time (kernels and
    copies summed, so a copy under a kernel counts twice), the top device and host events
    (with Adam beside backward, `fwd_bwd_host_s` holds the part of Adam run beside it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if is_cuda(dev):
        activities.append(ProfilerActivity.CUDA)
    sync(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        if beside:
            engine.backward_and_step(loss)
            t1 = time.perf_counter()
        else:
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
        sync(dev)
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {"wall_s": round(wall, 4), "fwd_bwd_host_s": round(t1 - t0, 4)}
    events = prof.key_averages()
    if is_cuda(dev):
        from torch.autograd import DeviceType

        device_us = 0.0
        copies_us = 0.0
        for e in events:  # the device's own events: an operator's row repeats its kernels'
            if e.device_type != DeviceType.CUDA:
                continue
            own = getattr(e, "self_device_time_total", None)
            if own is None:
                own = getattr(e, "self_cuda_time_total", 0.0)
            device_us += own
            if "memcpy" in e.key.lower() or "memset" in e.key.lower():
                copies_us += own
        out["device_busy_s"] = round(device_us / 1e6, 4)
        out["device_copies_s"] = round(copies_us / 1e6, 4)
        out["device_busy_fraction"] = round(device_us / 1e6 / wall, 3)
        table = events.table(sort_by="self_cuda_time_total", **TABLE)
        out["top_device"] = table.splitlines()
    table = events.table(sort_by="self_cpu_time_total", **TABLE)
    out["top_host"] = table.splitlines()
    return out


def _profiled(
    device: str, dev, cfg, data: list, memory: dict | None, beside: bool = False
) -> dict[str, Any]:
    import torch

    import pstar_core
    from pstar_core.models import build

    torch.manual_seed(0)
    engine = pstar_core.initialize(lambda: build(cfg), engine_config(device, memory))
    try:
        for x in data[:3]:  # warm-up: the tracer's iteration and two steps on its plan
            _train_step(engine, x, beside)
        host_wall, host_top = _host_profile(engine, data[3], dev, beside)
        result = _device_profile(engine, data[4], dev, beside)
        result["cprofile_step_s"] = round(host_wall, 4)
        result["cprofile_top"] = host_top
        stats = engine.stats()
        result["device_adam_chunks"] = stats["device_adam_chunks"]
        result["adam_beside_backward_chunks"] = stats["adam_beside_backward_chunks"]
    finally:
        engine.close()
    return result


def stage_profile(device: str, dev) -> Result:
    sizes = sizes_for(device)
    cfg = gpt_config(sizes.model, sizes.seq)
    data = batches(cfg, sizes, 5)
    numbers: dict[str, Any] = {"model": sizes.model}
    st = probe(cfg, data[:2], device, dev)
    memory = {"device_budget": budgets(st, dev)["params_evicted"]}
    numbers["params_evicted"] = _profiled(device, dev, cfg, data, memory)
    numbers["params_evicted_beside"] = _profiled(device, dev, cfg, data, memory, beside=True)
    return Result("pass", numbers)
