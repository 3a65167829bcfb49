"""`pstar bench scale` on tiny models: every system really trains; failures carry reasons."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from benchmarks.scale import run_scale
from service.cli import app

TINY = {"hidden": 64, "heads": 4, "vocab": 512, "seq": 16}


@pytest.fixture(scope="module")
def scale() -> dict:
    return run_scale(
        cap_gib=1.5, start_layers=1, max_layers=2, systems=("ours", "ours_disk", "fsdp2"), **TINY
    )


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
    assert scale["ratio_vs_best_peer"] == 1.0  # equal sizes at this cap: all fit
    assert scale["ratio_with_disk"] == 1.0


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
    bad = runner.invoke(app, ["bench", "scale", "--systems", "ours,megatron"])
    assert bad.exit_code != 0
    assert "megatron" in bad.output
