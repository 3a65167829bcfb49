"""`pstar bench faults` on a small schedule: two jobs on PostgreSQL through one SIGKILL of
the control plane, one of a running job's Ray driver and a 10 s outage of the store; none
lost, none run twice, each succeeds with every step once."""

from __future__ import annotations

import json

import pytest

from benchmarks.faults import run

pytestmark = pytest.mark.slow


def test_jobs_ride_out_a_killed_control_plane_a_killed_driver_and_a_store_outage(capsys):
    # seed 7 draws the order driver, control plane, store: the killed driver's job starts
    # a second attempt, so the later faults still find jobs training on a loaded machine
    # (seed 5 took the store down first, and on a loaded CI machine the jobs ended during
    # its outage, before the other two faults)
    out = run(jobs=2, steps=120, faults=3, db="postgres", outage_s=10.0, seed=7, json_out=True)
    assert out["per_db"][0]["why"] == []
    assert out["per_db"][0]["faults"] == {"control-plane": 1, "driver": 1, "store": 1}
    assert (out["jobs"], out["faults"]) == (2, 3)
    assert (out["lost"], out["duplicated"], out["wrong_state"]) == (0, 0, 0)
    # the killed driver's job needed a second attempt; nothing else did (the suite's one
    # test of a killed driver: its new attempt resumed, as every step is there once)
    assert out["per_db"][0]["attempts"] == 3
    assert out["p99_api_ms_during_faults"] is not None
    # the last line is the result (JSON keys are strings: the API's status counts')
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(
        json.dumps(out)
    )
