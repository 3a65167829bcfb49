"""Where a rank's chunks start, within the budgets, before the first iteration.

`initialize` calls these in order: `allocate` (before the weights are written),
`enforce_budgets` (after, once other ranks' chunks are dropped) and `pin_host_chunks`.
From then on `Residency` moves chunks as the iterations need them.
"""

from __future__ import annotations

import torch

from pstar_core.chunk import PARAM_LISTS, ChunkType
from pstar_core.residency import Residency
from pstar_core.tiers import DEVICE, DISK, HOST, HostArena, MemoryBudgetError, gib

ZERO_AT_START = (ChunkType.MOMENTUM, ChunkType.VARIANCE)


def allocate(r: Residency, streamed: bool = False) -> bool:
    """Every chunk of this rank the weights are written into starts in host memory,
    zeroed (FREE tensors read as 0); momentum and variance start as zeros without
    memory and are allocated at their first use (`Chunk.zero_pending`). Other ranks'
    chunks never get memory here: under ZeRO a rank materializes only its own share
    (their tensors are initialized into a staging buffer and dropped, see
    `materialize`).

    `streamed` (the weights stream from files into the slots, one tensor at a time):
    frozen chunks, too, get memory only when their first tensor arrives, and once all
    their tensors are in, they may spill to disk to make room for the next ones, so
    loading a frozen base (a LoRA model's) holds no more than the host budget. This
    needs room in the host budget for the trainable lists and one frozen chunk in
    flight; returns whether frozen chunks are lazy.

    Budgets are enforced right after the weights are materialized (`enforce_budgets`),
    which may spill chunks to disk.
    """
    check_total_fits(r)
    host = r.tiers[HOST]
    frozen = r.lists[ChunkType.FROZEN]
    eager = sum(
        c.nbytes
        for c in r.chunks()
        if r.owned(c) and c.kind not in (*ZERO_AT_START, ChunkType.FROZEN)
    )
    lazy = streamed and bool(frozen) and eager + 2 * frozen[0].nbytes <= host.budget_bytes
    for c in r.chunks():
        if not r.owned(c):
            continue
        if c.kind in ZERO_AT_START or (lazy and c.kind is ChunkType.FROZEN):
            c.zero_pending = True
            continue
        with r.tracer.chunk_memory():
            payload = host.allocate(c.capacity, c.dtype).zero_()
        r.adopt(c, payload, HOST)
    return lazy


def host_disk_shortfall(model_data_bytes: int, host_bytes: int, disk_bytes: int) -> int:
    """The chunk bytes of one rank that host and disk together cannot hold (0: they fit).
    The rule the engine starts by (`check_total_fits`) and the planner forecasts by: the
    warm-up step runs Adam on the host for every chunk, so every chunk passes through host
    memory or disk whatever the device holds."""
    return max(0, model_data_bytes - host_bytes - disk_bytes)


def check_total_fits(r: Residency) -> None:
    """Fail before training when the chunks cannot all pass through host and disk.

    The warm-up step runs Adam on the host for every chunk (placement is decided from
    its trace), so at its end every chunk is in host memory or on disk; the device
    budget cannot count here without risking a failure mid-run.
    """
    need = sum(c.nbytes for c in r.chunks() if r.owned(c))
    host, disk = r.tiers[HOST].budget_bytes, r.tiers[DISK].budget_bytes
    if host_disk_shortfall(need, host, disk):
        raise MemoryBudgetError(
            f"the model needs {gib(need)} of chunks (model data), the budgets give "
            f"{gib(host + disk)} (host {gib(host)}, disk {gib(disk)}; the warm-up step "
            "updates every chunk on the host, so the device budget does not count "
            "here; unset, the host budget is the memory available when the engine "
            "started less max(2 GiB, 10%), shared by this host's ranks); raise "
            "memory.host_budget or memory.disk_budget (with memory.disk_dir), free host "
            "memory, or use a smaller model / fewer trainable parameters"
        )


def device_share(r: Residency) -> int:
    """Chunk bytes the device may hold before the trace exists (warm-up or static)."""
    memory = r.memory
    ratio = memory.static_model_share if memory.policy == "static" else memory.warmup_ratio
    return int(ratio * r.tiers[DEVICE].budget_bytes)


def enforce_budgets(r: Residency) -> dict[str, int]:
    """After materialization: what the host budget cannot hold goes to the device (up to
    the share model data may use in warm-up), then to disk. Returns each tier's peak
    while loading (training's peaks are counted from here on)."""
    host, device = r.tiers[HOST], r.tiers[DEVICE]
    share = device_share(r)
    for c in r.chunks(PARAM_LISTS):
        if host.used_bytes <= host.budget_bytes:
            break
        if c.tier == HOST and device.used_bytes + c.nbytes <= share:
            r.move(c, DEVICE)
    order = [
        c
        for kind in (
            ChunkType.VARIANCE,
            ChunkType.MOMENTUM,
            ChunkType.PARAM_FP32,
            *PARAM_LISTS[::-1],
        )
        for c in r.lists[kind]
        if c.tier == HOST  # what the host cannot hold; chunks on the device stay there
    ]
    for c in reversed(order):  # the last chunks of the optimizer lists are needed last
        if host.used_bytes <= host.budget_bytes:
            break
        r.move(c, DISK)
    # Materialization holds all of this rank's chunks in host memory before this spill
    # (frozen chunks excepted when streamed, see `allocate`), so the loading peaks are
    # kept apart and training's are counted from here on.
    load_peaks = {str(name): t.peak_bytes for name, t in r.tiers.items()}
    for t in r.tiers.values():
        t.peak_bytes = t.iteration_peak_bytes = t.used_bytes
    return load_peaks


def pin_host_chunks(r: Residency) -> None:
    """After materialization (remote chunks dropped, budgets enforced): the host tier's
    chunks move into its pool, sized to what this rank can ever hold there. The pool is
    locked region by region as chunks are copied in, each old payload freed right after
    its copy (see [Note: the pool grows as it fills] in tiers.py), so the peak is the
    payloads plus one region, not the payloads plus the whole pool."""
    host = r.tiers[HOST]
    if not host.use_arena:
        return
    own = sum(HostArena.region_bytes(c.capacity, c.dtype) for c in r.chunks() if r.owned(c))
    # gradient accumulation adds an fp32 chunk per trainable chunk while it runs: address
    # space only until it does
    own += sum(
        HostArena.region_bytes(c.capacity, torch.float32)
        for c in r.lists[ChunkType.PARAM]
        if r.owned(c)
    )
    host.make_arena(min(own, host.budget_bytes))
    for c in r.chunks():
        if c.tier == HOST and c.payload is not None:
            with r.tracer.chunk_memory():
                pinned = host.allocate(c.capacity, c.dtype)
                pinned.copy_(c.payload)
                r.rehome(c, pinned)
