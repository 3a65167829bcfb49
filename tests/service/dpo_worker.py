"""One rank of the 2-rank DPO test (`tests/service/test_dpo.py`): the engine on a gloo
group over a file, chunk ZeRO across the ranks, the DPO objective on this rank's half of
each batch; writes the losses averaged over the ranks to `result-RANK.json`."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pstar_core
from service.methods.dpo_objective import DPO
from tests.service.test_dpo import (
    BATCH,
    BETA,
    CFG,
    STEPS,
    Sink,
    pairs_split,
    step_indices,
    tiny_llama,
)


def main(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    split = pairs_split()
    model = tiny_llama()
    local = BATCH // world
    losses = []
    with pstar_core.initialize(lambda: copy.deepcopy(model), CFG) as engine:
        dpo = DPO(BETA, False, tmp_path / "rows.ref.pt")
        dpo.prepare(engine, {"train": split}, rank, world, local, Sink())
        for step in range(STEPS):
            mine = step_indices(step)[rank * local : (rank + 1) * local]
            sums = dpo.train_step(engine, split.rows(mine, engine.device), 1)
            t = torch.tensor([sums["loss_sum"], sums["count"]], dtype=torch.float64)
            dist.all_reduce(t)
            losses.append((t[0] / t[1]).item())
        reference = split.reference.tolist()
    (tmp_path / f"result-{rank}.json").write_text(
        json.dumps({"losses": losses, "reference": reference})
    )
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see tests/core/zero_worker.py: a gloo thread may outlive finalization


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
