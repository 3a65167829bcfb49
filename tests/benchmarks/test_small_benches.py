"""`pstar bench adam | overhead | load` on tiny configurations: the last line is one JSON
object with the documented keys, and the numbers in it are measurements (positive)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from service.cli import app
from tests.tiny import make_tiny_llama

runner = CliRunner()


def last_json(args: list[str]) -> dict:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def test_bench_adam_reports_elements_per_second_against_torch():
    r = last_json(["bench", "adam", "--numel", "200000", "--repeats", "2", "--json"])
    for key in ("ours_elems_per_s", "torch_fused_elems_per_s", "torch_foreach_elems_per_s"):
        assert r[key] > 0, key
    assert r["ratio_vs_torch_fused"] == r["ours_elems_per_s"] / r["torch_fused_elems_per_s"]
    assert r["backend"] == "cpp"
    assert not any("gb" in k.lower() for k in r)  # nominal bytes are not reported


def test_bench_overhead_times_the_engine_and_both_torch_recipes():
    r = last_json(
        ["bench", "overhead", "--model", "gpt-tiny", "--seq", "16", "--steps", "2",
         "--warmup", "1", "--json"]
    )  # fmt: skip
    for key in ("engine_s", "torch_s", "torch_fp32_s", "ratio", "ratio_vs_fp32"):
        assert r[key] > 0, key
    assert len(r["step_times_s"]["engine"]) == 2
    assert all(v == v for v in r["final_loss"].values())  # finite (not NaN)


def test_bench_load_measures_both_loaders_on_a_real_directory(tmp_path):
    d = make_tiny_llama(tmp_path / "tiny")
    r = last_json(["bench", "load", str(d), "--repeats", "1", "--json"])
    assert r["file_bytes"] > 0
    for loader in ("engine", "transformers"):
        assert r[loader]["seconds"] > 0
        assert r[loader]["held_bytes"] > 0
