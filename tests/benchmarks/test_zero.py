"""ZeRO benchmarks on tiny models: every run in the dtype asked for, each rank's
initialize peak, and our measured comm volume vs theory."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from benchmarks.zero import run_zero
from pstar.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def zero() -> dict:
    # gpt-tiny packs into 4 param chunks: 2 communication groups over 2 ranks, so both
    # ranks own real chunks (no padding chunk) and the volume check is not trivial. fp32
    # is not what auto picks on a bf16 CPU: the peer must follow the flag, not the default.
    return run_zero(
        model="gpt-tiny", global_batch=2, seq=32, steps=1, warmup=1, peers=("fsdp2",),
        dtype="fp32",
    )  # fmt: skip


def test_run_zero_times_ours_on_1_and_2_ranks_and_fsdp2(zero):
    assert zero["model"] == "gpt-tiny"
    assert zero["ours_1rank_s"] > 0
    assert zero["ours_2rank_s"] > 0
    assert zero["fsdp2_s"] > 0
    assert zero["ratio_vs_fsdp2"] > 0
    assert zero["deepspeed_s"] is None  # not asked for
    assert zero["param_chunks"] == 4
    assert zero["own_param_chunks"] == [2, 2]


def test_every_run_computes_in_the_dtype_asked_for(zero):
    assert zero["compute_dtype"] == zero["engine_dtype"] == "fp32"
    assert zero["compute_dtype_seen"] == {
        "ours 1 rank": "fp32",
        "ours 2 ranks": "fp32",
        "FSDP2 2 ranks": "fp32",  # MixedPrecisionPolicy casts nothing in fp32
    }
    assert zero["cpu_capability"]


def test_each_rank_reports_its_peak_memory_during_initialize(zero):
    peaks = zero["init_peak_bytes"]
    assert [len(peaks[k]) for k in ("ours 1 rank", "ours 2 ranks", "FSDP2 2 ranks")] == [1, 2, 2]
    assert all(b > 0 for ranks in peaks.values() for b in ranks)


def test_our_counter_and_the_wire_count_agree_and_ranks_send_alike(zero):
    # `wire`: what each rank handed to torch.distributed (counted by wrapping its
    # collectives in the worker), per timed step; `comm_calls`: the engine's own counter
    n = 2
    assert zero["comm_bytes"] > 0
    assert zero["comm_bytes_per_rank"][0] == zero["comm_bytes_per_rank"][1]
    assert zero["wire"][0] == zero["wire"][1]
    for wire, ours in zip(zero["wire"], zero["comm_calls"], strict=True):
        # every collective the engine counted reached torch.distributed, and no other: the
        # groups' all-gathers and reduce-scatters, each after a failure flag's all-reduce
        # (the timed step is the first to record its sections' collectives), and one flag
        # at each of the step's 3 agreement points ([Note: agreed sections] in zero.py)
        assert set(wire) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert set(ours) == {"all_gather", "reduce_scatter", "failure_flag"}
        gather, scatter, flags = wire["all_gather"], wire["reduce_scatter"], wire["all_reduce"]
        assert gather["calls"] == ours["all_gather"]["calls"] > 0
        assert scatter["calls"] == ours["reduce_scatter"]["calls"] > 0
        assert flags["calls"] == ours["failure_flag"]["calls"]
        assert flags["calls"] == gather["calls"] + scatter["calls"] + 3
        # a gather gives one chunk and receives the group's n; a reduce-scatter the reverse
        assert gather["received_bytes"] == n * gather["given_bytes"]
        assert scatter["given_bytes"] == n * scatter["received_bytes"]
        # the engine counts the ring algorithms' share of those tensors ([Note: bytes sent]
        # in pstar_core/zero.py): (n-1) x the chunk given, (n-1) x the shard received, and
        # 2 (n-1)/n x each 104-byte flag (the failing rank and whether it left the agreed
        # collectives, then the collective's 4 codes and their negations: [Note:
        # collective order], whether this rank can issue it now: [Note: gathers ahead],
        # and a script's digest and its negation: [Note: agreed sections])
        assert ours["all_gather"]["bytes"] == (n - 1) * gather["given_bytes"]
        assert ours["reduce_scatter"]["bytes"] == (n - 1) * scatter["received_bytes"]
        assert ours["failure_flag"]["bytes"] == 2 * (n - 1) / n * flags["given_bytes"]
        assert flags["given_bytes"] == 104 * flags["calls"]
    assert zero["comm_bytes"] == sum(c["bytes"] for c in zero["comm_calls"][0].values())
    assert 0 < zero["comm_bytes_flags"] < 0.01 * zero["comm_bytes"]


def test_comm_bytes_equal_the_theoretical_volume(zero):
    # the theory: every group is all-gathered once in forward and once in backward and its
    # grads reduce-scattered once (the tied wte/lm_head group stays gathered between its
    # uses). Measured from the tensors handed to torch.distributed: the whole padded param
    # list received twice by the gathers and given once to the reductions
    param_list = zero["param_list_bytes"]
    for wire in zero["wire"]:
        assert wire["all_gather"]["received_bytes"] == 2 * param_list
        assert wire["reduce_scatter"]["given_bytes"] == param_list
    # and counted by the engine: each collective sending (n-1)/n of what it moves, 2 ranks:
    # 3 x 1/2 of the param list
    assert zero["comm_bytes"] - zero["comm_bytes_flags"] == 1.5 * param_list


def test_cli_collectives_prints_throughputs_and_ratio_as_the_last_json_line():
    # one launch covers both run_collectives and the command (2 worker processes)
    res = runner.invoke(
        app, ["bench", "collectives", "--model", "gpt-tiny", "--repeats", "2", "--json"]
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.output.strip().splitlines()[-1])
    for key in ("ratio", "chunked_gbps", "per_tensor_gbps", "bytes", "load_avg"):
        assert key in r, key
    assert r["ratio"] > 0
    assert r["chunked_gbps"] > 0
    assert r["per_tensor_gbps"] > 0
    assert r["gathered_ok"]
    # the same bytes (up to rounding each piece up to a multiple of the 2 ranks)
    for gathered in r["bytes_gathered"].values():
        assert r["bytes"] <= gathered <= r["bytes"] + 2 * 2 * r["calls"]["per_tensor"]
    assert r["calls"]["chunked"] < r["calls"]["per_tensor"]


def test_cli_zero_rejects_a_sequence_longer_than_the_model():
    res = runner.invoke(app, ["bench", "zero", "--model", "gpt-tiny", "--seq", "4096"])
    assert res.exit_code == 2
    assert "seq" in res.output
