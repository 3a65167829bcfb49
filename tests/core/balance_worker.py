"""A rank of the ZeRO balance tests (a module of its own so spawned processes import it):
an MLP stack laid out adversarially for chunk i -> rank i % N."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import pstar_core
from tests.core.helpers import mean_over_ranks

WIDTH = 64
CHUNK = WIDTH * WIDTH  # a weight fills a chunk exactly
GROUPS = 6


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.weight


def stack(nproc: int) -> nn.Module:
    """Per group of `nproc` chunks: a full chunk, a nearly empty one, then full ones; so
    under i % nproc rank 1 would own only the nearly empty chunks."""
    layers: list[nn.Module] = []
    for _ in range(GROUPS):
        layers += [Lin(), Scale(), *(Lin() for _ in range(nproc - 2))]
    return nn.Sequential(*layers)


def main(rank: int, world: int, tmp: str) -> None:
    out = Path(tmp)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{out / 'pg'}", rank=rank,
                                world_size=world)  # fmt: skip
    torch.set_num_threads(1)
    nproc = int(os.environ["BALANCE_NPROC"])
    torch.manual_seed(0)
    cfg = {"dtype": "fp32", "chunk_size": CHUNK, "optimizer": {"lr": 1e-2}}
    engine = pstar_core.initialize(lambda: stack(nproc), cfg)
    st = engine.stats()
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * nproc, WIDTH, generator=g)  # the global batch, split by rank
        y = torch.randn(4 * nproc, WIDTH, generator=g)
        rows = 4 * nproc // world
        part = slice(rank * rows, (rank + 1) * rows)
        loss = ((engine(x[part]) - y[part]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss, world))
    result = {
        "model_data_bytes": st["model_data_bytes"],
        "chunk_bytes": st["chunk_bytes"],
        "chunks": sum(v["count"] for v in st["chunks"].values()),
        "losses": losses,
        "comm_bytes_sent": engine.stats()["comm_bytes_sent"],
    }
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    if world > 1:
        dist.destroy_process_group()
    os._exit(0)  # see tests/core/zero_worker.py


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
