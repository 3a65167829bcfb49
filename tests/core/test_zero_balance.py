"""ZeRO shards hold 1/N of the model data within one chunk per list, for any layout."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pstar_core.mapping import balanced_owners, make_plan
from tests.core.balance_worker import CHUNK, stack
from tests.core.helpers import spawn_ranks

ROOT = Path(__file__).resolve().parents[2]
BYTES_PER_ELEM = 16  # fp32: param, master, momentum, variance


def spread(used: list[int], owners, nproc: int) -> int:
    held = [0] * nproc
    for u, r in zip(used, owners, strict=False):
        held[r] += u
    return max(held) - min(held)


@pytest.mark.parametrize("nproc", [2, 3, 4, 5, 8])
def test_owners_stay_within_one_chunk_for_random_and_adversarial_fills(nproc):
    rng = random.Random(nproc)
    size = 1000
    layouts = [[rng.randint(0, size) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    # fullest chunk always at the same place in a group: the layout i % N fails on
    layouts.append([size if i % nproc != 1 else 3 for i in range(10 * nproc)])
    for used in layouts:
        owners = balanced_owners(used, nproc)
        assert len(owners) % nproc == 0
        assert len(owners) >= len(used)
        for g in range(0, len(owners), nproc):  # one chunk of every group per rank
            assert sorted(owners[g : g + nproc]) == list(range(nproc))
        assert spread(used, owners, nproc) <= size
    adversarial = layouts[-1]
    round_robin = [i % nproc for i in range(len(adversarial))]
    assert spread(adversarial, round_robin, nproc) >= 9 * size  # what it replaces


def launch(world: int, tmp: Path, nproc: int) -> list[dict]:
    return spawn_ranks("tests.core.balance_worker", world, tmp, BALANCE_NPROC=str(nproc))


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_ranks_hold_equal_shares_of_an_adversarial_layout_and_plan_says_so(nproc, tmp_path):
    single = launch(1, tmp_path / "one", nproc)[0]
    ranks = launch(nproc, tmp_path / "many", nproc)
    total = single["model_data_bytes"]
    for r in ranks:  # within one chunk of each of the 4 lists of an equal share
        assert abs(r["model_data_bytes"] - total / nproc) <= CHUNK * BYTES_PER_ELEM
        assert r["comm_bytes_sent"] > 0
    assert sum(r["model_data_bytes"] for r in ranks) == total
    # the same training as one rank with the whole batch
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
    )
    # `pstar plan --nproc N` (Plan.per_rank) says what each rank really holds
    m = stack(nproc)
    params = list(m.parameters())
    plan = make_plan(
        [p.numel() for p in params], [True] * len(params), [""] * len(params), "fp32", CHUNK
    )
    planned = plan.per_rank(nproc)
    assert [p["model_data_bytes"] for p in planned] == [r["model_data_bytes"] for r in ranks]
    assert [p["chunk_bytes"] for p in planned] == [r["chunk_bytes"] for r in ranks]
