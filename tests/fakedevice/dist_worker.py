"""One rank of the fakenccl test: `python -m tests.fakedevice.dist_worker RANK WORLD PORT`.

Runs every collective on fakegpu tensors through ``cpu:gloo,fakegpu:fakenccl`` and
checks the results; exits non-zero (with the traceback on stderr) on the first failure.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from tests import fakedevice

F = "fakegpu"


def expect_raises(fn, *needles: str) -> str:
    try:
        fn()
    except Exception as exc:  # the error type comes back through c10d and pybind
        text = str(exc)
        print(f"expected error: {type(exc).__name__}: {text.splitlines()[0]}", file=sys.stderr)
        missing = [n for n in needles if n not in text]
        assert not missing, f"error {text!r} lacks {missing}"
        return text
    raise AssertionError(f"no error; expected one mentioning {needles}")


def check(rank: int, world: int) -> None:
    r = rank + 1  # rank-dependent values: rank r contributes r + 1
    ranks_sum = sum(range(1, world + 1))

    # allreduce: SUM, AVG, MAX; sync and async (outputs appear at wait())
    t = torch.full((5,), float(r), device=F)
    dist.all_reduce(t)
    assert t.device.type == F
    assert t.cpu().tolist() == [float(ranks_sum)] * 5
    t = torch.full((3,), float(r), device=F)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.cpu().tolist() == [ranks_sum / world] * 3, t
    t = torch.full((3,), float(r), device=F)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.cpu().tolist() == [float(world)] * 3
    t = torch.full((4,), float(r), device=F)
    work = dist.all_reduce(t, async_op=True)
    assert t.cpu().tolist() == [float(r)] * 4  # not written before wait(), as on a GPU
    work.wait()
    assert t.cpu().tolist() == [float(ranks_sum)] * 4

    # allreduce into a view of a flat buffer (chunk-style) only touches the view
    flat = torch.zeros(10, device=F)
    flat[2:6] = float(r)
    dist.all_reduce(flat[2:6])
    assert flat.cpu().tolist() == [0.0] * 2 + [float(ranks_sum)] * 4 + [0.0] * 4

    # broadcast, reduce
    t = torch.full((3,), float(r), device=F)
    dist.broadcast(t, src=1)
    assert t.cpu().tolist() == [2.0] * 3
    t = torch.full((3,), float(r), device=F)
    dist.reduce(t, dst=0)
    if rank == 0:
        assert t.cpu().tolist() == [float(ranks_sum)] * 3

    # all_gather (list) and all_gather_into_tensor
    inp = torch.arange(3, dtype=torch.float32, device=F) + 10 * rank
    outs = [torch.empty(3, device=F) for _ in range(world)]
    dist.all_gather(outs, inp)
    for i, o in enumerate(outs):
        assert o.device.type == F
        assert o.cpu().tolist() == [10.0 * i, 10.0 * i + 1, 10.0 * i + 2]
    out = torch.empty(3 * world, device=F)
    work = dist.all_gather_into_tensor(out, inp, async_op=True)
    work.wait()
    assert out.cpu().tolist() == [10.0 * i + j for i in range(world) for j in range(3)]
    out = torch.empty(3 * world, device=F)
    dist.all_gather_single(out, inp)  # 2.13's name for all_gather_into_tensor
    assert out.cpu().tolist() == [10.0 * i + j for i in range(world) for j in range(3)]

    # reduce_scatter (list) and reduce_scatter_tensor
    chunks = [torch.full((2,), float(r * (i + 1)), device=F) for i in range(world)]
    o = torch.empty(2, device=F)
    dist.reduce_scatter(o, chunks)
    assert o.cpu().tolist() == [float(ranks_sum * (rank + 1))] * 2
    big = torch.arange(2 * world, dtype=torch.float32, device=F) * r
    o = torch.empty(2, device=F)
    dist.reduce_scatter_tensor(o, big)
    expect = (torch.arange(2 * world, dtype=torch.float32) * ranks_sum)[2 * rank : 2 * rank + 2]
    assert torch.equal(o.cpu(), expect), o
    o = torch.empty(2, device=F)
    dist.reduce_scatter_tensor(o, big, op=dist.ReduceOp.AVG)
    assert torch.equal(o.cpu(), expect / world), o
    o = torch.empty(2, device=F)
    dist.reduce_scatter_single(o, big)  # 2.13's name for reduce_scatter_tensor
    assert torch.equal(o.cpu(), expect), o

    # barrier; CPU tensors still go to gloo in the same group
    dist.barrier()
    c = torch.full((2,), float(r))
    dist.all_reduce(c)
    assert c.device.type == "cpu"
    assert c.tolist() == [float(ranks_sum)] * 2

    # what NCCL refuses: a CPU tensor handed to the fakegpu backend
    cpu_in = torch.arange(3, dtype=torch.float32)
    expect_raises(lambda: dist.all_gather_single(out, cpu_in), "_allgather_base", "cpu")
    backend = dist.group.WORLD._get_backend(torch.device(F))
    assert backend.name() == "fakenccl", backend.name()
    expect_raises(
        lambda: backend.allreduce([torch.ones(2)], dist.AllreduceOptions()), "allreduce", "cpu"
    )
    # a group with fakenccl alone has no backend for CPU tensors at all (as NCCL alone)
    only = dist.new_group(backend="fakenccl")
    t = torch.full((2,), float(r), device=F)
    dist.all_reduce(t, group=only)
    assert t.cpu().tolist() == [float(ranks_sum)] * 2
    expect_raises(lambda: dist.all_reduce(torch.ones(2), group=only), "cpu")
    dist.barrier(group=only)
    dist.barrier()


def main(rank: int, world: int, port: int) -> None:
    fakedevice.load()
    dist.init_process_group(
        backend=f"cpu:gloo,{F}:fakenccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        check(rank, world)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
