"""fakenccl: an NCCL stand-in for fakegpu tensors, built on gloo.

``dist.init_process_group(backend="cpu:gloo,fakegpu:fakenccl")`` routes CPU tensors to
gloo and fakegpu tensors here. Like NCCL, every collective accepts device tensors only: a
CPU tensor raises, naming the op and the device. Each collective copies its inputs to the
host, starts the same gloo collective (on a gloo backend of its own), and returns a Work
whose ``wait()`` waits for gloo and only then writes the fakegpu outputs; reading an
output of an ``async_op=True`` collective before ``wait()`` sees the old values, as on a
GPU where the kernel has not run yet.

Why a C++ shim: torch 2.13's ``torch._C._distributed_c10d.Backend`` has no Python
constructor ("No constructor defined!"), and a creator that returns a Python
``dist.ProcessGroup`` subclass replaces the whole process group (distributed_c10d breaks
out of the backend loop), which would drop the gloo backend for CPU tensors. So
``fakegpu.cpp`` defines ``FakeNcclBackend`` (a real ``c10d::Backend``) that forwards each
collective to the `_Collectives` object below, and the logic stays here.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

NAME = "fakenccl"
_REDUCE_OPS = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
}


def _check(op: str, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "fakegpu":
            raise ValueError(
                f"fakenccl {op}: got a tensor on {t.device}; like NCCL, it only takes "
                f"device (fakegpu) tensors"
            )


def _host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to("cpu") for t in tensors]


Polled = tuple[c10d.Work, Callable[[], bool]]  # a work and its poll (see `_work`)


def _work(inner: c10d.Work, done: Callable[[], None], watch: bool = False) -> Polled:
    """A Work whose wait() waits for the gloo work, then runs `done` (the copy-back) once;
    and its poll, which the C++ shim makes the Work's is_completed(): true once the gloo
    work is done (its outputs are written at the wait, which then does not stall).
    `watch`: gloo's own is_completed() stays false until a wait (its `_reduce_scatter_base`
    in torch 2.13), so a thread waits for it and says when it is done."""
    state = {"done": False, "landed": False}
    if watch:

        def landed() -> None:
            with contextlib.suppress(Exception):  # the caller's wait() raises it
                inner.wait()
            state["landed"] = True

        threading.Thread(target=landed, daemon=True, name="fakenccl-watch").start()

    def wait(timeout: datetime.timedelta) -> bool:
        if not state["done"]:
            inner.wait() if timeout == datetime.timedelta(0) else inner.wait(timeout)
            done()
            state["done"] = True
        return True

    def poll() -> bool:
        return state["done"] or state["landed"] or inner.is_completed()

    return c10d.PythonCallbackWork(wait), poll


def _copy_back(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Callable[[], None]:
    def done() -> None:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    return done


def _reduce_op(op: str) -> dist.ReduceOp:
    if op not in _REDUCE_OPS:
        raise ValueError(f"fakenccl: unsupported reduce op {op}")
    return _REDUCE_OPS[op]


class _Collectives:
    """What FakeNcclBackend (C++) calls; each method returns a c10d Work and its poll."""

    def __init__(self, gloo: c10d.Backend) -> None:
        self.gloo = gloo

    def allreduce(self, tensors: list[torch.Tensor], op: str) -> Polled:
        _check("allreduce", tensors)
        host = _host(tensors)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = _reduce_op(op)
        return _work(self.gloo.allreduce(host, opts), _copy_back(tensors, host))

    def broadcast(self, tensors: list[torch.Tensor], root: int) -> Polled:
        _check("broadcast", tensors)
        host = _host(tensors)
        opts = c10d.BroadcastOptions()
        opts.rootRank = root
        return _work(self.gloo.broadcast(host, opts), _copy_back(tensors, host))

    def reduce(self, tensors: list[torch.Tensor], root: int, op: str) -> Polled:
        _check("reduce", tensors)
        host = _host(tensors)
        opts = c10d.ReduceOptions()
        opts.rootRank = root
        opts.reduceOp = _reduce_op(op)
        return _work(self.gloo.reduce(host, opts), _copy_back(tensors, host))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Polled:
        _check("allgather", [*inputs, *(t for out in outputs for t in out)])
        host_out = [_host(out) for out in outputs]
        flat_dst = [t for out in outputs for t in out]
        flat_src = [t for out in host_out for t in out]
        work = self.gloo.allgather(host_out, _host(inputs), c10d.AllgatherOptions())
        return _work(work, _copy_back(flat_dst, flat_src))

    def allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> Polled:
        _check("_allgather_base (all_gather_single)", [output, input])
        host_out = output.to("cpu")
        work = self.gloo._allgather_base(host_out, input.to("cpu"), c10d.AllgatherOptions())
        return _work(work, _copy_back([output], [host_out]))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], op: str
    ) -> Polled:
        _check("reduce_scatter", [*outputs, *(t for inp in inputs for t in inp)])
        host_out = _host(outputs)
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(op)
        work = self.gloo.reduce_scatter(host_out, [_host(inp) for inp in inputs], opts)
        return _work(work, _copy_back(outputs, host_out), watch=True)

    def reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Polled:
        _check("_reduce_scatter_base (reduce_scatter_single)", [output, input])
        host_out = output.to("cpu")
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = _reduce_op(op)
        work = self.gloo._reduce_scatter_base(host_out, input.to("cpu"), opts)
        return _work(work, _copy_back([output], [host_out]), watch=True)

    def barrier(self) -> Polled:
        return _work(self.gloo.barrier(c10d.BarrierOptions()), lambda: None)


def _create(
    ext: ModuleType, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> c10d.Backend:
    # a gloo backend of its own, under its own keys of the group's store
    gloo = c10d.ProcessGroupGloo(c10d.PrefixStore(f"{NAME}/", store), rank, size, timeout)
    return ext.FakeNcclBackend(rank, size, _Collectives(gloo))


def register(ext: ModuleType) -> None:
    """Make ``fakenccl`` a c10d backend for the ``fakegpu`` device (idempotent); `ext` is
    the device's built extension, which holds the backend class."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, functools.partial(_create, ext), devices=["fakegpu"])
