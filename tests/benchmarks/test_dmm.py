"""DMM benchmarks and the trace plot on tiny models: keys, policy order, PNG, CLI errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import pstar_core
from benchmarks.dmm import choose_chunk_size, run_eviction
from benchmarks.report import bench_dtype
from pstar.cli import app
from pstar_core.models import build
from service.tools.plot_trace import plot_run_dir, plot_trace

runner = CliRunner()


@pytest.fixture(scope="module")
def eviction() -> dict:
    # 4 layers and vocab 256 give 12 chunks of a tiny model, so eviction has choices and the
    # static share at the tight budget still holds an operator's chunks; 1.0 fits it all.
    return run_eviction(
        model="gpt-tiny", layers=4, vocab=256, batch=2, seq=32, iters=3, fractions=(0.3, 1.0)
    )


def test_run_eviction_returns_the_documented_keys(eviction):
    for key in (
        "bytes_moved", "total_moved", "lower_bound", "model", "params", "chunk_bytes",
        "peak_non_model_bytes", "load_avg", "sp_over_opt_total", "model_data_chunk_bytes",
    ):  # fmt: skip
        assert key in eviction, key
    assert set(eviction["bytes_moved"]) == {"opt", "lru", "static"}
    assert set(eviction["lower_bound"]) == {"0.3", "1"}
    assert eviction["model"] == "gpt-tiny"
    assert eviction["peak_non_model_bytes"] > 0
    assert 12 <= eviction["param_chunks"] <= 20
    assert eviction["compute_dtype"] == bench_dtype("auto")  # the default: auto, resolved
    assert eviction["cpu_capability"]


def test_opt_beats_lru_everywhere_and_moves_nothing_once_everything_fits(eviction):
    moved = eviction["bytes_moved"]
    for budget in ("0.3", "1"):
        assert moved["opt"][budget] <= moved["lru"][budget], budget
        for policy in ("opt", "lru", "static"):
            total = eviction["total_moved"][policy][budget]
            assert total >= moved[policy][budget]
    assert moved["opt"]["1"] == 0
    assert eviction["total_moved"]["opt"]["1"] == 0
    # the static partition keeps optimizer states (and Adam) on the host: every param
    # chunk goes there and back each step, however large the device
    assert moved["static"]["1"] >= eviction["param_chunk_bytes_total"]
    assert eviction["sp_over_opt_total"] > 1


def test_an_impossible_budget_is_reported_infeasible_not_raised():
    result = run_eviction(
        model="gpt-tiny", layers=2, vocab=None, batch=2, seq=32, iters=3, fractions=(0.001,),
        policies=("static",), chunk_size=32768,
    )  # fmt: skip
    assert result["bytes_moved"]["static"]["0.001"] == "infeasible"


def test_choose_chunk_size_lands_in_range_and_holds_the_largest_tensor():
    numels = [50_000] + [10_000] * 100
    size = choose_chunk_size(numels)
    assert size >= 50_000
    assert size % 1024 == 0


@pytest.fixture(scope="module")
def tiny_stats() -> dict:
    engine = pstar_core.initialize(
        lambda: build("gpt-tiny"), {"memory": {"device_budget": 2_000_000}}
    )
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    out = engine(input_ids=x, labels=x)
    engine.backward(out.loss)
    engine.step()
    return json.loads(json.dumps(engine.stats()))  # as the training loop writes it


def test_plot_trace_writes_a_png_from_real_stats(tmp_path, tiny_stats):
    out = plot_trace(tiny_stats, tmp_path / "sub" / "trace.png", title="gpt-tiny")
    assert out.is_file()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


def test_plot_run_dir_and_cli_read_trace_json(tmp_path, tiny_stats):
    (tmp_path / "trace.json").write_text(json.dumps(tiny_stats))
    assert plot_run_dir(tmp_path).name == "trace.png"
    result = runner.invoke(app, ["plot-trace", str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.png").stat().st_size > 0


def test_cli_plot_trace_without_trace_json_fails_clearly(tmp_path):
    result = runner.invoke(app, ["plot-trace", str(tmp_path)])
    assert result.exit_code == 2
    text = " ".join(result.output.split())  # rich wraps long lines
    assert f"no trace.json in {tmp_path}; run pstar train first" in text


def test_plot_trace_rejects_stats_without_a_trace(tmp_path):
    with pytest.raises(ValueError, match="no memory trace"):
        plot_trace({"tracer": {"moments": 0}}, tmp_path / "x.png")


def test_disk_prefetch_bench_prints_both_modes_and_one_json_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PSTAR_SPILL_DIR", str(tmp_path))
    args = ["bench", "eviction", "--disk", "--model", "gpt-tiny", "--layers", "4", "--vocab"]
    args += ["256", "--batch", "2", "--seq", "32", "--trials", "1", "--dtype", "fp32", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert set(data["s_per_iter"]) == {"off", "on"}
    assert data["same_losses"] is True
    assert data["prefetched_chunks"]["off"] == 0
    assert data["disk_bytes_moved"]["off"]["disk->host"] > 0  # the disk tier is in use
    assert data["ratio_on_over_off"] > 0
    assert "prefetch off vs on" in result.output
    assert data["compute_dtype"] == "fp32"
    assert "fp32 on CPU" in result.output
