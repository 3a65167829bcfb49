"""The worker side of `pstar bench zero` and `pstar bench collectives`: one process per
rank (`python -m benchmarks.zero_worker --worker KIND`, started by `benchmarks.zero`),
which counts what it hands to torch.distributed (`WireCounter`), runs ours, FSDP2,
DeepSpeed or the collectives, and writes its result as JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.report import (
    deepspeed_precision,
    fsdp2_precision,
    peak_rss_growth,
    torch_dtype,
    watch_compute_dtype,
)

_LR = 1e-4


class WireCounter:
    """The tensors this rank hands to torch.distributed's collectives, counted by wrapping
    them: per collective kind, the calls and the bytes of the tensors it gives (to be sent
    to the others) and receives into, as passed. Only the outermost call counts, as some
    wrap others internally.

    Given and received, per kind: an all-gather gives its input and receives the list (or
    buffer) of all ranks' pieces; a reduce-scatter gives its list (or buffer) and receives
    its shard; an all-reduce gives and receives its tensor; a broadcast gives its tensor on
    the source and receives it elsewhere; a reduce gives its tensor except on the
    destination, which receives.
    """

    # function -> (kind, the parameter holding what it gives, what it receives into)
    SPECS: ClassVar[dict[str, tuple[str, str, str]]] = {
        "all_gather": ("all_gather", "tensor", "tensor_list"),
        "all_gather_into_tensor": ("all_gather", "input_tensor", "output_tensor"),
        "all_gather_single": ("all_gather", "input_tensor", "output_tensor"),
        "_all_gather_base": ("all_gather", "input_tensor", "output_tensor"),
        "reduce_scatter": ("reduce_scatter", "input_list", "output"),
        "reduce_scatter_tensor": ("reduce_scatter", "input", "output"),
        "reduce_scatter_single": ("reduce_scatter", "input", "output"),
        "_reduce_scatter_base": ("reduce_scatter", "input", "output"),
        "all_reduce": ("all_reduce", "tensor", "tensor"),
        "broadcast": ("broadcast", "tensor", "tensor"),
        "reduce": ("reduce", "tensor", "tensor"),
    }

    def __init__(self) -> None:
        # kind -> [calls, bytes given, bytes received]
        self.by_kind: dict[str, list[int]] = {}
        self.by_call: dict[str, int] = {}  # function -> calls, to see the path taken
        self._depth = threading.local()

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        # Both names: DeepSpeed calls some collectives through distributed_c10d directly.
        for mod in (dist, c10d):
            for name, spec in self.SPECS.items():
                fn = getattr(mod, name, None)
                if fn is not None and not getattr(fn, "_pstar_wrapped", False):
                    setattr(mod, name, self._wrap(fn, name, *spec))

    def snapshot(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self.by_kind.items()}

    def since(self, mark: dict[str, list[int]], steps: int) -> dict[str, dict[str, float]]:
        """Per step since `mark`: kind -> calls, bytes given, bytes received."""
        out = {}
        for kind, now in self.by_kind.items():
            was = mark.get(kind, [0, 0, 0])
            calls, given, received = (n - w for n, w in zip(now, was, strict=True))
            if calls:
                out[kind] = {
                    "calls": calls / steps,
                    "given_bytes": given / steps,
                    "received_bytes": received / steps,
                }
        return out

    def _wrap(self, fn: Callable[..., Any], name: str, kind: str, give: str, get: str) -> Any:
        import inspect

        signature = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                passed = signature.bind(*args, **kwargs).arguments
                given, received = _nbytes(passed[give]), _nbytes(passed[get])
                if kind in ("broadcast", "reduce"):
                    root = _is_root(passed, "src" if kind == "broadcast" else "dst")
                    # broadcast: the source gives, the others receive; reduce: the
                    # others give, the destination receives
                    if (kind == "broadcast") == root:
                        received = 0
                    else:
                        given = 0
                entry = self.by_kind.setdefault(kind, [0, 0, 0])
                entry[0] += 1
                entry[1] += given
                entry[2] += received
                self.by_call[name] = self.by_call.get(name, 0) + 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        wrapper._pstar_wrapped = True  # type: ignore[attr-defined]
        return wrapper


def _nbytes(t: Any) -> int:
    """Bytes of a tensor, or of a list of them, as passed."""
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _is_root(passed: dict[str, Any], role: str) -> bool:
    """Whether this rank is the broadcast's source (`role` "src") or the reduce's
    destination ("dst"), named by global rank or by rank in the group."""
    import torch.distributed as dist

    group = passed.get("group")
    if passed.get(f"group_{role}") is not None:
        return dist.get_rank(group) == passed[f"group_{role}"]
    return dist.get_rank() == (passed.get(role) or 0)


def ring_sent(wire: dict[str, dict[str, float]], nproc: int) -> float:
    """What the standard algorithms make a rank send for the collectives counted in
    `wire` (the model of [Note: bytes sent] in pstar_core/zero.py): an all-gather (N-1) x
    what it gives, a reduce-scatter (N-1) x what it receives, a ring all-reduce
    2 (N-1)/N x its tensor, a broadcast (N-1) x its tensor on the source, a reduce its
    tensor once."""
    factor = {
        "all_gather": nproc - 1,
        "broadcast": nproc - 1,
        "reduce": 1,
        "all_reduce": 2 * (nproc - 1) / nproc,
    }
    total = 0.0
    for kind, w in wire.items():
        if kind == "reduce_scatter":
            total += (nproc - 1) * w["received_bytes"]
        else:
            total += factor[kind] * w["given_bytes"]
    return total


def _init_dist(world: int) -> None:
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")


def _barrier(world: int) -> None:
    import torch.distributed as dist

    if world > 1:
        dist.barrier()


def _batches(spec: dict[str, Any], rank: int, world: int) -> list[Any]:
    """Every rank draws the same global batches and keeps its part (rank r: chunk r)."""
    import torch

    from pstar_core.models import get_config

    vocab = get_config(spec["model"]).vocab_size
    gen = torch.Generator().manual_seed(1234)
    shape = (spec["global_batch"], spec["seq"])
    n = spec["warmup"] + spec["steps"]
    return [torch.randint(0, vocab, shape, generator=gen).chunk(world)[rank] for _ in range(n)]


def _timed_loop(
    spec: dict[str, Any],
    world: int,
    batches: list[Any],
    step: Callable[[Any], float],
    on_warm: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Warm-up steps, `on_warm()`, then timed steps; returns (step times, losses)."""
    times, losses = [], []
    for i, x in enumerate(batches):
        if i == spec["warmup"]:
            on_warm()  # counters are read here, so only the timed steps count
        _barrier(world)  # ranks start each step together: its time is the slowest rank's
        t0 = time.perf_counter()
        loss = step(x)
        dt = time.perf_counter() - t0
        if i >= spec["warmup"]:
            times.append(dt)
            losses.append(loss)
    return times, losses


def _worker_ours(spec: dict[str, Any], rank: int, world: int, wire: WireCounter) -> dict:
    import torch

    import pstar_core
    from pstar_core.chunk import ChunkType
    from pstar_core.models import build

    torch.manual_seed(0)
    with peak_rss_growth() as init:
        engine = pstar_core.initialize(
            lambda: build(spec["model"]),
            {
                "dtype": spec["dtype"],
                "chunk_size": spec.get("chunk_size") or "auto",
                "optimizer": {"lr": _LR},
                "zero": {
                    "variant": spec.get("variant", "collective"),
                    "agree_per_collective": spec.get("agree_per_collective", False),
                },
            },
        )
    seen = watch_compute_dtype(engine.module)

    def step(x: torch.Tensor) -> float:
        out = engine(input_ids=x, labels=x)
        engine.backward(out.loss)
        engine.step()
        return float(out.loss.detach())

    marks: dict[str, Any] = {}

    def on_warm() -> None:
        stats = engine.stats()
        marks["engine"] = stats["comm_bytes_sent"]
        marks["calls"] = stats["comm_calls"]
        marks["flag_s"] = stats["comm_flag_s"]
        marks["wire"] = wire.snapshot()

    times, losses = _timed_loop(spec, world, _batches(spec, rank, world), step, on_warm)
    stats = engine.stats()
    nproc = engine.zero.nproc
    param_bytes = sum(c.nbytes for c in engine.manager.lists[ChunkType.PARAM])
    frozen_bytes = sum(c.nbytes for c in engine.manager.lists[ChunkType.FROZEN])
    share = (nproc - 1) / nproc
    was = marks["calls"]
    calls = {  # the engine's counter per collective, per timed step
        k: {f: (v[f] - was.get(k, {}).get(f, 0)) / spec["steps"] for f in ("calls", "bytes")}
        for k, v in stats["comm_calls"].items()
    }
    measured = wire.since(marks["wire"], spec["steps"])
    return {
        "times": times,
        "losses": losses,
        "comm_bytes": (stats["comm_bytes_sent"] - marks["engine"]) / spec["steps"],
        "comm_calls": {k: v for k, v in calls.items() if v["calls"]},
        # of which the failure flags (a 104-byte all-reduce before each collective outside
        # an agreed section and at each agreement point: the flag and the collective's
        # codes, [Note: collective order] and [Note: agreed sections] in pstar_core/zero.py)
        "comm_bytes_flags": calls.get("failure_flag", {}).get("bytes", 0),
        "flag_s": (stats["comm_flag_s"] - marks["flag_s"]) / spec["steps"],
        "wire": measured,  # what was handed to torch.distributed, per timed step
        "comm_bytes_wire": ring_sent(measured, nproc),
        "wire_by_call": wire.by_call,  # whole run, warm-up and set-up included
        "theory_bytes": 3 * share * param_bytes + 2 * share * frozen_bytes,
        "param_list_bytes": param_bytes,
        "chunk_size": stats["chunk_size"],
        "param_chunks": len(engine.manager.lists[ChunkType.PARAM]),
        "own_param_chunks": stats["chunks"]["param"]["count"],
        "own_param_used_bytes": stats["chunks"]["param"]["used_bytes"],
        "threads": torch.get_num_threads(),
        "init_peak_bytes": init["bytes"],
        "init_new_modules": init["new_modules"],
        "compute_dtype_seen": seen(),
        "engine_dtype": stats["precision"]["dtype"],
    }


def _worker_fsdp2(spec: dict[str, Any], rank: int, world: int, wire: WireCounter) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pstar_core.models import build

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    with peak_rss_growth() as init:
        net = build(spec["model"])
        mp = fsdp2_precision(spec["dtype"])
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(net, mesh=mesh, mp_policy=mp)  # the root: wte (= lm_head), wpe, ln_f
    opt = torch.optim.AdamW(net.parameters(), lr=_LR, foreach=True)

    def step(x: torch.Tensor) -> float:
        loss = net(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return _peer_result(spec, rank, world, wire, step, net, init["bytes"])


def _worker_deepspeed(spec: dict[str, Any], rank: int, world: int, wire: WireCounter) -> dict:
    import deepspeed
    import torch

    from pstar_core.models import build

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    offload = {"device": "cpu", "pin_memory": False}
    config = {
        "train_batch_size": spec["global_batch"],
        "train_micro_batch_size_per_gpu": spec["global_batch"] // world,
        "gradient_accumulation_steps": 1,
        **deepspeed_precision(spec["dtype"]),
        "optimizer": {"type": "AdamW", "params": {"lr": _LR, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            "offload_optimizer": offload,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    with peak_rss_growth() as init:
        net = build(spec["model"])
        engine, *_ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=config
        )

    def step(x: torch.Tensor) -> float:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return _peer_result(spec, rank, world, wire, step, engine.module, init["bytes"])


def _peer_result(
    spec: dict[str, Any],
    rank: int,
    world: int,
    wire: WireCounter,
    step: Callable[[Any], float],
    module: Any,
    init_peak_bytes: int | None,
) -> dict:
    import torch

    seen = watch_compute_dtype(module)
    marks: dict[str, Any] = {}

    def on_warm() -> None:
        marks["wire"] = wire.snapshot()

    times, losses = _timed_loop(spec, world, _batches(spec, rank, world), step, on_warm)
    measured = wire.since(marks["wire"], spec["steps"])
    return {
        "times": times,
        "losses": losses,
        "wire": measured,
        "comm_bytes_wire": ring_sent(measured, world),
        "wire_by_call": wire.by_call,  # whole run, warm-up and set-up included
        "threads": torch.get_num_threads(),
        "init_peak_bytes": init_peak_bytes,
        "compute_dtype_seen": seen(),
    }


def _worker_collectives(spec: dict[str, Any], rank: int, world: int, wire: WireCounter) -> dict:
    import torch
    import torch.distributed as dist

    from pstar_core.mapping import make_plan
    from pstar_core.models import build

    with torch.device("meta"):
        params = list(build(spec["model"]).parameters())  # tied weights once
    numels = [p.numel() for p in params]
    names = [str(i) for i in range(len(params))]
    dtype = torch_dtype(spec["dtype"])
    esize = dtype.itemsize
    chunk_size = spec.get("chunk_size") or "auto"
    plan = make_plan(numels, [True] * len(params), names, spec["dtype"], chunk_size)
    size, total = plan.chunk_size, sum(numels)
    # Chunked: a communication group per all-gather, each rank giving one chunk (the last
    # group trimmed to what is left), so both variants gather the model's bytes.
    chunked, left = [], total
    while left > 0:
        shard = min(size, math.ceil(left / world))
        chunked.append(shard)
        left -= shard * world
    per_tensor = [math.ceil(n / world) for n in numels]

    def buffers(shards: list[int]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        out = []
        for n in shards:
            own = torch.full((n,), float(rank), dtype=dtype)
            out.append((own, [torch.empty(n, dtype=dtype) for _ in range(world)]))
        return out

    variants = {"chunked": buffers(chunked), "per_tensor": buffers(per_tensor)}

    def run(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for own, outs in variants[name]:
            dist.all_gather(outs, own)  # the engine's call (list form)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
        return float(dt.item())

    times: dict[str, list[float]] = {"chunked": [], "per_tensor": []}
    for i in range(spec["repeats"] + 1):  # round 0 warms up buffers and connections
        for name in ("chunked", "per_tensor"):
            dt = run(name)
            if i > 0:
                times[name].append(dt)
    ok = all(float(t[0]) == r for r, t in enumerate(variants["chunked"][0][1]))
    return {
        "times": times,
        "chunk_size": size,
        "calls": {"chunked": len(chunked), "per_tensor": len(per_tensor)},
        "bytes": {
            k: esize * world * sum(v) for k, v in (("chunked", chunked), ("per_tensor", per_tensor))
        },
        "model_bytes": esize * total,
        "gathered_ok": ok,
    }


_WORKERS = {
    "ours": _worker_ours,
    "fsdp2": _worker_fsdp2,
    "deepspeed": _worker_deepspeed,
    "collectives": _worker_collectives,
}


def _worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=sorted(_WORKERS), required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    spec = json.loads(a.spec)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec["threads"])
    wire = WireCounter()
    wire.install()  # before DeepSpeed or FSDP2 look the collectives up
    if a.worker != "deepspeed":  # DeepSpeed initializes the group itself
        _init_dist(world)
    result = _WORKERS[a.worker](spec, rank, world, wire)
    Path(a.out, f"result-{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Skip interpreter finalization: a gloo run-loop thread can still hold the last
    # reference to a finished collective's tensors, and dropping it while Python
    # finalizes aborts the process (std::terminate; seen about 1 run in 8 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
