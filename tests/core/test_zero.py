"""Chunk ZeRO-DP over 2 gloo ranks equals 1 rank with the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pstar_core.hf import load_causal_lm
from tests.core.helpers import spawn_ranks


def launch(name: str, world: int, tmp: Path, **env) -> list[dict]:
    """Run the scenario in `world` fresh processes (rank r gets its half of each batch)."""
    return spawn_ranks("tests.core.zero_worker", world, tmp, name, **env)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return launch("train", 1, tmp_path_factory.mktemp("single"))[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return launch("train", 2, tmp_path_factory.mktemp("pair"))


def test_two_ranks_match_one_rank_with_the_global_batch(single, pair):
    ranks = pair
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
    )
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # each rank holds half of the model data (within one chunk of each list)
    chunk = single["stats_before"]["chunk_size"]
    half = single["stats_before"]["model_data_bytes"] / 2
    for r in ranks:
        assert abs(r["stats_before"]["model_data_bytes"] - half) <= chunk * 14
        assert r["comm_bytes"] > 0


def test_a_torch_without_the_2_13_collective_names_trains_bitwise_the_same(pair, tmp_path):
    """torch before 2.13 has `all_gather_into_tensor` / `reduce_scatter_tensor` only: the
    engine falls back to them (on a GPU image's torch, the 2.13 names raised
    AttributeError at the first gather). The fakegpu test runs the single-buffer path."""
    ranks = launch("train", 2, tmp_path, PSTAR_TEST_OLD_TORCH="1")
    import torch.distributed as dist

    assert ranks[0]["collective_names"] == []  # the names were gone in the ranks
    has = hasattr(dist, "all_gather_single")  # 2.13 or later, running these tests
    assert pair[0]["collective_names"] == (["all_gather_single"] if has else [])
    assert ranks[0]["losses"] == pair[0]["losses"]


def test_a_rank_leaving_the_agreed_collectives_fails_every_rank_with_what_it_did(tmp_path):
    """[Note: agreed sections]: once the sections run without flags, rank 1's batch skips
    two layers in the fifth step: it is about to gather another group than the agreed
    one. It raises `CollectiveMismatch`, issues the agreed rest with stand-ins, and rank 0
    raises the same error at the next point; both go on in step, agreeing anew. An
    evaluation between a forward and its backward ends the forward's section: its
    collectives are not a departure."""
    ranks = launch("depart", 2, tmp_path)
    for r in ranks:
        assert r["evaluated"] > 0
        assert r["agreed"][4] > 0  # the fifth step's sections had agreed collectives
        [(step, kind, message)] = r["errors"]
        assert (step, kind) == (4, "CollectiveMismatch")
        assert "rank 1 left the collectives the ranks agreed on for the forward" in message
        assert "all_gather of param group 2" in message
        assert "all_gather of param group 1 (4096 elements) next" in message
    assert ranks[0]["errors"] == ranks[1]["errors"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert len(ranks[0]["losses"]) == 6
    # a departure forgets the scripts: the next two steps record them again
    assert ranks[0]["agreed"][5] == ranks[0]["agreed"][6]


def test_ranks_reaching_different_collectives_all_raise_naming_each_ones(tmp_path):
    """A model whose branch depends on the data: rank 0 uses one layer, rank 1 another,
    so their gradient reductions come in different orders on equal-sized groups (which
    NCCL would pair silently). The flags carry the operation: both ranks raise, each
    naming both ranks' collectives, and go on in step with agreeing data."""
    ranks = launch("diverge", 2, tmp_path)
    for r in ranks:
        [(kind, message)] = r["errors"]
        assert kind == "CollectiveMismatch"
        assert "rank 0: " in message
        assert "rank 1: " in message
        assert "param group" in message
    assert ranks[0]["errors"] == ranks[1]["errors"]
    assert ranks[0]["after"] == ranks[1]["after"]


def test_two_ranks_under_a_device_budget_that_forces_eviction(single, tmp_path):
    # about the measured activations of a rank plus 40% of the param chunks
    memory = json.dumps({"device_budget": 750_000})
    ranks = launch("train", 2, tmp_path, PSTAR_TEST_MEMORY=memory)
    assert ranks[0]["moved"].get("device->host", 0) > 0
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
    )


def test_serial_broadcast_variant_equals_the_collective_one(pair, tmp_path):
    collective = pair  # the collective variant is the default
    serial = launch("train", 2, tmp_path / "s", PSTAR_TEST_VARIANT="serial")
    torch.testing.assert_close(
        torch.tensor(serial[0]["losses"]), torch.tensor(collective[0]["losses"]), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("budget", [None, 750_000], ids=["roomy", "evicting"])
def test_overlapped_reductions_equal_waiting_for_each(pair, tmp_path, budget):
    """Reduce-scatters left in flight while backward goes on (the GPU default), also
    across the gathers of the next groups, give the same numbers as waiting for each,
    also when the device must evict to make room."""
    memory = json.dumps({"device_budget": budget} if budget else {})
    env = {"PSTAR_TEST_MEMORY": memory}
    if budget is None:  # the default on the CPU waits for each: the pair's own run
        waited = pair
    else:
        waited = launch("train", 2, tmp_path / "w", PSTAR_TEST_OVERLAP="off", **env)
    overlapped = launch("train", 2, tmp_path / "o", PSTAR_TEST_OVERLAP="on", **env)
    assert overlapped[0]["losses"] == waited[0]["losses"]
    assert overlapped[0]["overlapped"] > 0
    assert waited[0]["overlapped"] == 0
    # the collectives are the single-buffer ones, one per group and direction
    calls = overlapped[0]["comm_calls"]
    assert calls["all_gather"]["calls"] > 0
    assert calls["reduce_scatter"]["calls"] > 0
    assert calls == waited[0]["comm_calls"]
    if budget is None:
        # a reduction is not waited for at the next group's gather: it stays in flight
        # for several operators (about 2.7 each when every gather waited for them all)
        assert overlapped[0]["overlapped"] >= 3 * calls["reduce_scatter"]["calls"]


@pytest.mark.parametrize("budget", [None, 750_000], ids=["roomy", "evicting"])
def test_groups_gathered_ahead_of_their_use_give_the_same_numbers(pair, tmp_path, budget):
    """[Note: gathers ahead]: once the trace is followed, the next group's all-gather is
    issued while the current operator computes, where every rank has room (agreed in the
    gather's flag); losses are bitwise those of gathering each group at its use, and the
    collectives the same ones."""
    memory = json.dumps({"device_budget": budget} if budget else {})
    env = {"PSTAR_TEST_MEMORY": memory}
    at_use = pair if budget is None else launch("train", 2, tmp_path / "u", **env)
    ahead = launch("train", 2, tmp_path / "a", PSTAR_TEST_AHEAD="on", **env)
    assert at_use[0]["gathered_ahead"] == 0  # off on the CPU by default
    assert ahead[0]["gathered_ahead"] > 0
    assert ahead[0]["gathered_ahead"] == ahead[1]["gathered_ahead"]
    assert ahead[0]["losses"] == at_use[0]["losses"]
    assert ahead[0]["comm_calls"]["all_gather"] == at_use[0]["comm_calls"]["all_gather"]
    # [Note: agreed sections]: with a flag before every collective (each gather ahead
    # agreed in its own), the same numbers and the same gathers ahead; by default the
    # sections run on their agreed collectives, from the third step on, with a third
    # fewer flag exchanges or less (3 points a step, against 3 groups' collectives)
    flagged = launch(
        "train", 2, tmp_path / "f", PSTAR_TEST_AHEAD="on", PSTAR_TEST_PER_COLLECTIVE="1", **env
    )
    assert flagged[0]["losses"] == ahead[0]["losses"]
    assert flagged[0]["gathered_ahead"] == ahead[0]["gathered_ahead"]
    assert flagged[0]["agreed_sections"] == 0
    for r in ahead:
        assert r["agreed_sections"] >= 2 * (len(r["losses"]) - 4), r["agreed_sections"]
        assert r["flag_exchanges"] <= 0.6 * flagged[0]["flag_exchanges"], r["flag_exchanges"]


def test_micro_batches_on_agreed_collectives_equal_a_flag_before_each(tmp_path):
    """[Note: agreed sections] with two micro-batches a step, under a budget that evicts,
    reductions overlapped and groups gathered ahead: each micro-batch's forward and
    backward are sections of their own (the second stashes gradients first, so its
    collectives differ), agreed apart; bitwise the same as a flag before every
    collective, with under half the exchanges."""
    env = {
        "PSTAR_TEST_MICRO": "2",
        "PSTAR_TEST_AHEAD": "on",
        "PSTAR_TEST_OVERLAP": "on",
        "PSTAR_TEST_MEMORY": json.dumps({"device_budget": 750_000}),
    }
    agreed = launch("train", 2, tmp_path / "a", **env)
    flagged = launch("train", 2, tmp_path / "f", PSTAR_TEST_PER_COLLECTIVE="1", **env)
    assert agreed[0]["losses"] == flagged[0]["losses"]
    assert agreed[0]["gathered_ahead"] == flagged[0]["gathered_ahead"] > 0
    for r in agreed:  # 4 sections a step, agreed from the third step on
        assert r["agreed_sections"] >= 4 * (len(r["losses"]) - 4), r["agreed_sections"]
        assert r["flag_exchanges"] < 0.5 * flagged[0]["flag_exchanges"]


def test_a_rank_without_room_for_an_agreed_gather_ahead_makes_room(pair, tmp_path):
    """[Note: agreed sections]: in a section on its agreed collectives, a gather ahead is
    issued where the script says, with no flag. From the fifth step, rank 1's own chunk
    of each group is on the host when it is asked (as if the device were full): it
    makes room (the chunk back on the device) and gathers with rank 0, the same
    numbers."""
    ranks = launch("train", 2, tmp_path, PSTAR_TEST_AHEAD="on", PSTAR_TEST_NO_ROOM_AHEAD="1")
    assert ranks[0]["losses"] == pair[0]["losses"]
    assert ranks[0]["ahead_made_room"] == 0
    assert ranks[1]["ahead_made_room"] > 0
    assert ranks[0]["gathered_ahead"] == ranks[1]["gathered_ahead"] > 0


def test_each_rank_pools_only_its_own_host_chunks(single, tmp_path):
    ranks = launch("train", 2, tmp_path, PSTAR_HOST_ARENA="1")
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
    )
    for r in ranks:
        pool = r["host_pool"]
        assert pool["fallbacks"] == 0
        # its own chunks and their accumulation buffers, never the other rank's
        assert r["own_bytes"] < pool["bytes"] < 2 * r["own_bytes"]


def test_sharded_save_load_continue_equals_uninterrupted(tmp_path):
    ranks = launch("resume", 2, tmp_path)
    assert ranks[0]["resumed"] == ranks[0]["straight"]
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "rank0-of-2.safetensors" in files
    assert "rank1-of-2.safetensors" in files


@pytest.mark.parametrize("arena", ["0", "1"], ids=["mappings", "pinned-pool"])
def test_save_with_the_disk_tier_streams_chunk_by_chunk_and_resumes_bitwise(tmp_path, arena):
    """A host budget below each rank's model data, the rest spilled to disk, 2 ranks: the
    save brings spilled chunks back one at a time, so it adds at most one chunk of memory
    (collecting them in one dict kept every chunk it evicted alive: 3 chunks here), and
    resuming is bitwise, also with the host chunks sliced from one pool."""
    memory = {"host_budget": 200_000, "disk_budget": 10_000_000, "disk_dir": str(tmp_path)}
    ranks = launch(
        "resume", 2, tmp_path, PSTAR_TEST_MEMORY=json.dumps(memory), PSTAR_HOST_ARENA=arena
    )
    for r in ranks:
        assert r["resumed"] == r["straight"]
        assert r["spilled"] > 0
        assert r["save_growth_bytes"] <= r["chunk_bytes_max"], r


@pytest.mark.parametrize("variant", ["collective", "serial"])
def test_a_rank_that_fails_takes_the_others_out_of_the_same_iteration(tmp_path, variant):
    """One rank's forward fails (batch 3), one rank's own code fails between forward and
    backward (batch 5), one rank's backward fails (batch 7): every rank raises, the other
    one `RankFailed` with the failing rank's reason, and all go on in step, as if those
    batches had been left out. Each failure comes in a section that runs on its agreed
    collectives, with no flags: the failing rank issues the rest with stand-ins (the
    serial variant's: broadcasts and reductions)."""
    failed = launch("fail", 2, tmp_path / "f", PSTAR_TEST_VARIANT=variant)
    skipped = launch("skip", 2, tmp_path / "s", PSTAR_TEST_VARIANT=variant)
    assert failed[0]["losses"] == skipped[0]["losses"]
    assert failed[1]["losses"] == skipped[1]["losses"]
    errors = [[3, "MemoryError"], [5, "RankFailed"], [7, "RuntimeError"]]
    assert [e[:2] for e in failed[1]["errors"]] == errors
    errors = [[3, "RankFailed"], [5, "ValueError"], [7, "RankFailed"]]
    assert [e[:2] for e in failed[0]["errors"]] == errors
    assert "rank 1 failed: RuntimeError: a hook failed in backward" in failed[0]["errors"][2][2]
    # agreed sections ran in batches 3, 4, 5 and 6 (a failure forgets no script)
    agreed = failed[0]["agreed"]
    assert agreed[3] < agreed[4] < agreed[5] < agreed[6] < agreed[7], agreed
    assert "rank 1 failed: MemoryError: out of memory in block 1" in failed[0]["errors"][0][2]
    assert (
        "rank 0 failed: RuntimeError: abandon_iteration() was called" in (failed[1]["errors"][1][2])
    )


def test_two_ranks_from_a_pretrained_directory_equal_one_full_and_lora(tmp_path):
    from tests.core.helpers import MODELS, reference_model

    reference_model(MODELS["hf_gpt2"]).save_pretrained(tmp_path / "src")
    single = launch("from_dir", 1, tmp_path / "1")[0]
    ranks = launch("from_dir", 2, tmp_path / "2")
    for name in ("full", "lora"):
        torch.testing.assert_close(
            torch.tensor(ranks[0][name]), torch.tensor(single[name]), rtol=1e-5, atol=0
        )


def test_random_init_on_two_ranks_gives_the_one_rank_weights(tmp_path):
    """Each rank initializes only its own chunks, but the model's init code still runs
    over every tensor in order (others' into a staging buffer), so the weights are the
    ones one rank would draw from the same seed."""
    single = launch("init", 1, tmp_path / "1")[0]
    ranks = launch("init", 2, tmp_path / "2")
    assert ranks[0]["tensors"] == single["tensors"]
    assert ranks[1]["tensors"] == single["tensors"]


def test_a_rank_materializes_only_its_own_share(tmp_path):
    """The peak memory `initialize` adds on each of 2 ranks (VmHWM, ~50M parameters in
    fp32: 8 bytes each at init) is about half of one rank's: the other rank's chunks never
    exist here."""
    single = launch("init_memory", 1, tmp_path / "1")[0]["init_peak_growth"]
    ranks = [r["init_peak_growth"] for r in launch("init_memory", 2, tmp_path / "2")]
    assert single > 300 * 2**20  # the model data itself
    for grown in ranks:
        assert grown < 0.6 * single, (grown, single)


def test_hf_export_of_a_two_rank_run_loads_with_the_same_logits(tmp_path):

    ranks = launch("export", 2, tmp_path)
    model = load_causal_lm(tmp_path / "hf")
    from tests.core.helpers import batches

    with torch.no_grad():
        logits = model(input_ids=batches(1, seed=9)[0]).logits
    torch.testing.assert_close(logits, torch.tensor(ranks[0]["logits"]), rtol=1e-5, atol=1e-5)
