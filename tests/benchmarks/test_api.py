"""`pstar bench api` in a very short mode on SQLite: the last line is one JSON object with
the documented keys, every accepted create is stored exactly once, and the numbers are
sane (correctness, not speed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pstar.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def result() -> dict:
    args = ["bench", "api", "--db", "sqlite", "--seconds", "2", "--clients", "5"]
    args += ["--rate", "25", "--saturation-seconds", "1", "--rounds", "1", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_last_line_has_the_headline_keys_for_sqlite(result):
    for key in ("p50_ms", "p99_ms", "rps", "lost", "db", "results", "load_avg", "goal_met"):
        assert key in result, key
    assert result["db"] == "sqlite"
    assert set(result["results"]) == {"sqlite"}
    assert result["clients"] == 5


def test_every_accepted_create_is_stored_exactly_once(result):
    store = result["results"]["sqlite"]["store"]
    assert result["lost"] == store["lost"] == 0
    assert store["accepted"] > 0
    # nothing failed, so nothing was stored that a client was not told about
    assert store["unacknowledged"] == 0
    assert store["stored"] == store["accepted"]


def test_latencies_and_throughput_are_sane(result):
    assert result["rps"] > 0
    assert result["p99_ms"] >= result["p50_ms"] > 0
    assert result["errors"] == 0
    paced = result["results"]["sqlite"]["paced"]
    for op in ("create", "get", "list"):
        assert paced["by_op"][op]["requests"] > 0, op
    assert sum(paced["by_op"][op]["requests"] for op in paced["by_op"]) == paced["requests"]
    # latency from the scheduled send includes the time from the actual send
    assert paced["p99_ms"] >= paced["service_p99_ms"] > 0
    assert result["saturation_rps"] > 0
