"""`pstar bench scale` on tiny models: every system really trains, in the dtype asked for,
and reports its set-up's peak memory; failures carry reasons."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from benchmarks.report import bench_dtype
from benchmarks.scale import run_scale
from pstar.cli import app

TINY = {"hidden": 64, "heads": 4, "vocab": 512, "seq": 16}


@pytest.fixture(scope="module")
def scale() -> dict:
    # fp32 is not what auto picks on a bf16 CPU: the peer must follow the flag
    return run_scale(
        cap_gib=1.5, start_layers=1, max_layers=2, systems=("ours", "ours_disk", "fsdp2"),
        dtype="fp32", **TINY,
    )  # fmt: skip


def test_every_system_trains_two_steps_with_finite_losses_under_the_cap(scale):
    for system in ("ours", "ours_disk", "fsdp2"):
        r = scale["systems"][system]
        assert r["layers"] == 2, r
        assert r["at_least"] is True  # the largest size tried trained
        for t in r["trials"]:
            assert t["ok"], t
            assert len(t["losses"]) == 2
            assert 0 < t["peak_rss_bytes"] <= scale["cap_bytes"]
    assert scale["largest_params"]["ours"] == scale["largest_params"]["fsdp2"] > 0
    assert scale["largest_params"]["ours_disk"] == scale["largest_params"]["ours"]


def test_every_system_computes_in_the_dtype_asked_for(scale):
    assert scale["compute_dtype"] == "fp32"
    assert scale["compute_dtype_seen"] == {"ours": "fp32", "ours_disk": "fp32", "fsdp2": "fp32"}
    for r in scale["systems"].values():
        assert all(t["compute_dtype_seen"] == "fp32" for t in r["trials"])


def test_each_trial_reports_the_peak_memory_of_its_set_up_within_its_whole_peak(scale):
    for system, r in scale["systems"].items():
        assert 0 < r["init_peak_bytes"] == scale["init_peak_bytes"][system]
        for t in r["trials"]:
            # the set-up's rise sits on what the process held before it, under the peak
            assert 0 < t["init_peak_bytes"] < t["peak_rss_bytes"], system


def test_a_trial_over_the_cap_is_killed_and_reported_with_its_reason():
    r = run_scale(cap_gib=0.25, start_layers=1, max_layers=2, systems=("ours",), **TINY)
    ours = r["systems"]["ours"]
    assert ours["layers"] == 0
    assert ours["failed_at"] == 1
    assert ours["failure"].startswith("killed at the cap")
    assert r["ratio_vs_best_peer"] is None  # no peer ran


def test_cli_prints_the_json_line_last_and_rejects_unknown_systems():
    runner = CliRunner()
    res = runner.invoke(
        app,
        ["bench", "scale", "--cap-gib", "1.5", "--hidden", "64", "--seq", "16",
         "--start-layers", "1", "--max-layers", "1", "--systems", "ours", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    last = json.loads(res.output.strip().splitlines()[-1])
    assert last["largest_layers"] == {"ours": 1}
    assert last["compute_dtype"] == last["compute_dtype_seen"]["ours"] == bench_dtype("auto")
    bad = runner.invoke(app, ["bench", "scale", "--systems", "ours,megatron"])
    assert bad.exit_code != 0
    assert "megatron" in bad.output
