"""`pstar bench overlap` on a tiny GPT: on the fake device with a modeled link it counts,
per phase, the copy time issued and the time the host waited for it, under a budget that
evicts params and one that splits Adam; the last line is one JSON object with the three
figures issue 32 sets goals for."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pstar.cli import app

pytestmark = pytest.mark.fakegpu

ARGS = ["bench", "overlap", "--model", "gpt-tiny", "--layers", "3", "--vocab", "256"]
ARGS += ["--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1", "--json"]


@pytest.fixture(scope="module")
def result() -> dict:
    res = CliRunner().invoke(app, ARGS)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_copies_are_counted_per_phase_and_the_evicting_budget_moves_params(result):
    evicting = result["runs"]["params_evicted"]
    assert result["adam_beside_backward"]  # the default: backward_and_step
    assert evicting["adam_beside_backward_chunks"] > 0  # gradients landed during backward
    phases = evicting["phases"]
    assert phases["forward"]["issued_s"] > 0  # params came back over the link
    for phase in phases.values():
        assert 0 <= phase["exposed_s"] <= phase["issued_s"] + 1e-6
        if phase["hidden_fraction"] is not None:
            assert 0 <= phase["hidden_fraction"] <= 1
    assert evicting["device_adam_chunks"] == 0
    split = result["runs"]["adam_split"]
    assert 0 < split["device_adam_chunks"] < split["own_chunks"]


def test_the_last_line_has_the_three_figures_the_issue_sets_goals_for(result):
    assert 0 <= result["hidden_fraction_fwd_bwd"] <= 1
    assert result["optimizer_over_max"] > 0
    assert result["link_slowdown"] > 0
    assert result["link_GBps"] > 0
    # the planner's step time for each run, from the rates the run measured
    for run in result["runs"].values():
        assert run["forecast_step_s"] > 0
        measured = run["free_step_s_with_link"]
        assert run["forecast_over_measured"] == run["forecast_step_s"] / measured
    assert result["forecast_over_measured"] in {
        r["forecast_over_measured"] for r in result["runs"].values()
    }
    assert result["compute_dtype"] in ("bf16", "fp32")
