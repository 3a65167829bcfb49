"""`pstar bench adam | overhead | load` on tiny configurations: the last line is one JSON
object; every recipe runs in the dtype asked for (or the one auto resolves to here), and
says so; adam reports each host kernel per chunk dtype and thread count."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from benchmarks.report import bench_dtype, median
from pstar.cli import app
from tests.tiny import make_tiny_llama

runner = CliRunner()


def invoke(args: list[str]) -> tuple[dict, str]:
    """The command's last JSON line, and everything it printed (the table)."""
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1]), res.output


def last_json(args: list[str]) -> dict:
    return invoke(args)[0]


ADAM = ["bench", "adam", "--numel", "20000", "--repeats", "1", "--json"]


@pytest.fixture(scope="module")
def adam_run() -> tuple[dict, str]:
    return invoke([*ADAM, "--threads", "1", "--threads", "2"])


@pytest.fixture(scope="module")
def adam(adam_run) -> dict:
    return adam_run[0]


@pytest.mark.requires_compiler  # ours is one of the two kernels
def test_bench_adam_times_both_host_kernels_per_chunk_dtype_and_thread_count(adam_run):
    adam, printed = adam_run
    assert adam["threads"] == [1, 2]
    assert adam["backends_run"] == ["cpp", "fused"]
    assert set(adam["elems_per_s"]) == {"bf16", "fp32"}
    for dtype, by_threads in adam["elems_per_s"].items():
        assert set(by_threads) == {"1", "2"}, dtype
        for rates in by_threads.values():
            assert set(rates) == set(adam["backends_run"])
            assert all(r > 0 for r in rates.values())
    assert set(adam["torch_adamw_fused_elems_per_s"]) == {"1", "2"}
    # every rate and ratio comes from the kernels' own timings, reported beside them: one
    # timed call per round (--repeats 1), each kernel timed on its own
    times = adam["times_s"]
    for dtype in ("bf16", "fp32"):
        for n in ("1", "2"):
            cpp, fused = times[f"{dtype}/cpp/{n}"], times[f"{dtype}/fused/{n}"]
            assert len(cpp) == len(fused) == 1
            assert cpp != fused  # two measurements, not one reported twice
            rates = adam["elems_per_s"][dtype][n]
            assert rates["cpp"] == adam["numel"] / median(cpp)  # JSON keeps doubles exact
            assert rates["fused"] == adam["numel"] / median(fused)
            # cpp ÷ fused in speed is fused ÷ cpp in time; the bench divides the two rates
            # (three roundings of 2^-53 relative each, against one here): 1e-15 is 4.5 ulp
            ratio = adam["ratio_cpp_vs_fused"][dtype][n]
            assert ratio == pytest.approx(median(fused) / median(cpp), rel=1e-15)
    # and the table shows both kernels beside torch's own AdamW
    for row in ("cpp (ours)", "fused (torch's)", "torch AdamW fused"):
        assert row in printed, row


def test_bench_adam_reports_the_engines_default_kernel_per_dtype_and_threads(adam):
    for dtype in ("bf16", "fp32"):
        assert set(adam["default_backend"][dtype]) == {"1", "2"}
        assert set(adam["default_backend"][dtype].values()) <= {"cpp", "fused"}
    assert adam["forced_by_env"] is None
    assert adam["compute_dtype"] == bench_dtype("auto")
    assert adam["cpu_capability"]
    assert not any("gb" in k.lower() for k in adam)  # nominal bytes are not reported


def test_bench_adam_forcing_a_backend_shows_in_the_default_and_is_restored(monkeypatch):
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", "fused")
    r = last_json([*ADAM, "--threads", "1", "--dtype", "fp16"])
    assert r["forced_by_env"] == "fused"
    assert r["default_backend"] == {d: {"1": "fused"} for d in ("bf16", "fp32", "fp16")}
    assert r["compute_dtype"] == "fp16"
    assert set(r["elems_per_s"]) == {"bf16", "fp32", "fp16"}  # fp16 chunks when asked for
    # timing each backend set the variable per call; the user's setting is back
    assert os.environ["PSTAR_ADAM_BACKEND"] == "fused"


def test_bench_adam_rejects_a_bad_thread_count_and_dtype():
    assert runner.invoke(app, [*ADAM, "--threads", "0"]).exit_code == 2
    bad = runner.invoke(app, [*ADAM, "--dtype", "fp8"])
    assert bad.exit_code == 2
    assert "fp8" in bad.output


OVERHEAD = ["bench", "overhead", "--model", "gpt-tiny", "--seq", "16", "--steps", "1"]
OVERHEAD += ["--warmup", "1", "--json"]


def test_bench_overhead_in_fp32_runs_every_recipe_in_fp32_against_plain_torch():
    res = runner.invoke(app, [*OVERHEAD, "--dtype", "fp32"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output.strip().splitlines()[-1])
    assert r["compute_dtype"] == r["engine_dtype"] == "fp32"
    assert r["seen_compute_dtype"] == {"engine": "fp32", "torch fp32": "fp32"}
    # no bf16+master recipe in fp32: the baseline is plain fp32 torch, and the table says so
    assert r["baseline"] == "torch fp32"
    assert r["torch_master_s"] is None
    assert "torch fp32+fp32 master" in r["not_run"]
    assert "not run" in res.output
    assert r["engine_s"] > 0
    assert r["baseline_s"] > 0
    assert "fp32 on CPU" in res.output
    # the ratio is of two recipes' own step times, reported beside it (one step each)
    engine, torch_fp32 = r["step_times_s"]["engine"], r["step_times_s"]["torch fp32"]
    assert engine != torch_fp32  # two measurements, not one reported twice
    assert (r["engine_s"], r["baseline_s"]) == (median(engine), median(torch_fp32))
    assert r["ratio"] == median(engine) / median(torch_fp32)
    assert "torch fp32 (baseline)" in res.output


@pytest.mark.fakegpu
def test_bench_overhead_on_a_device_with_streams_runs_every_recipe_there():
    """On fakegpu the engine's per-operator prefetch bookkeeping runs (it does not on the
    CPU, where nothing can be copied ahead); plain torch runs the same kernels there."""
    args = [*OVERHEAD, "--dtype", "fp32", "--device", "fakegpu", "--layers", "3"]
    r = last_json([*args, "--chunk-size", "4096"])
    assert (r["device"], r["layers"]) == ("fakegpu", 3)
    losses = r["final_loss"]
    assert losses["engine"] == pytest.approx(losses["torch fp32"], rel=1e-5)
    # a second engine whose chunks are smaller than the embedding: it spans, same losses
    assert "wte.weight" in r["spanning"]
    assert r["spanned_losses_equal"] is True
    spanned = r["step_times_s"]["engine, chunks of 4096"]
    assert r["spanned_over_engine"] == median(spanned) / median(r["step_times_s"]["engine"])
    res = runner.invoke(app, [*OVERHEAD, "--device", "tpu"])
    assert res.exit_code != 0
    assert "runs on cpu or fakegpu" in res.output


def test_bench_overhead_in_bf16_compares_with_the_bf16_master_recipe():
    r = last_json([*OVERHEAD, "--dtype", "bf16"])
    assert r["compute_dtype"] == r["engine_dtype"] == "bf16"
    assert r["baseline"] == "torch bf16+fp32 master"
    assert r["seen_compute_dtype"] == {
        "engine": "bf16",
        "torch bf16+fp32 master": "bf16",
        "torch fp32": "fp32",
    }
    assert r["torch_master_s"] > 0
    assert all(v == v for v in r["final_loss"].values())  # finite (not NaN)


def test_bench_load_loads_both_sides_in_the_dtype_asked_for(tmp_path):
    d = make_tiny_llama(tmp_path / "tiny")
    r = last_json(["bench", "load", str(d), "--repeats", "1", "--dtype", "fp32", "--json"])
    assert r["compute_dtype"] == "fp32"
    for loader in ("engine", "transformers"):
        assert r[loader]["held_dtype"] == "fp32", loader
        assert r[loader]["seconds"] > 0
        assert r[loader]["held_bytes"] > 0
    assert r["load_avg"]["before"]
    assert r["load_avg"]["after"]


def test_bench_plan_sets_the_planner_beside_the_paper_and_the_engine():
    """`pstar bench plan`: the paper's four configurations (each within one step of the
    paper's answer where memory bounded it), its chunk-size table, and the forecast of
    gpt-tiny under three budget splits against the engine's own figures."""
    got, out = invoke(["bench", "plan", "--models", "gpt-tiny", "--json"])
    assert [c["case"] for c in got["paper_cases"]] == [
        "YARD 1 GPU", "YARD 8 GPUs", "SuperPod 1 GPU", "SuperPod 8 GPUs"
    ]  # fmt: skip
    assert got["paper_cases_within_one_step"] is True
    assert [(r["model"], r["split"]) for r in got["forecast"]] == [
        ("gpt-tiny", "roomy"), ("gpt-tiny", "params"), ("gpt-tiny", "tight")
    ]  # fmt: skip
    assert got["max_prediction_error"] == max(r["max_error"] for r in got["forecast"]) <= 0.10
    assert len(got["chunk_table"]) == 7
    assert "forecast vs engine" in out
    assert got["cpu_capability"]
    assert got["compute_dtype"] == "fp32"
    bad = runner.invoke(app, ["bench", "plan", "--models", "gpt-2"])
    assert bad.exit_code == 2
    assert "--models" in bad.output


def test_bench_primitives_measures_every_case_through_the_sdk_on_a_tiny_model(tmp_path):
    """`pstar bench primitives` on the tiny Llama, one round of tiny cases: a step through
    the SDK and one direct, save-to-first-token, sampled tokens against generate's, time
    to first token at 1 and N requests, the dtype it trained in."""
    model = make_tiny_llama(tmp_path / "tiny-llama")
    out, table = invoke(
        [
            "bench", "primitives", str(model), "--rounds", "1", "--prompts", "2",
            "--samples", "2", "--max-tokens", "3", "--batch", "2", "--seq", "8", "--rank", "2",
            "--dtype", "fp32", "--json",
        ]
    )  # fmt: skip
    assert out["compute_dtype"] == "fp32"
    assert out["sdk_step_s"] > 0
    assert out["direct_step_s"] > 0
    # the ratio of the unrounded medians; the times are printed to the millisecond
    ratio = out["sdk_step_s"] / out["direct_step_s"]
    assert out["step_ratio"] == pytest.approx(
        ratio, abs=0.0006 * (1 + ratio) / out["direct_step_s"]
    )
    assert out["save_to_first_token_s"] > 0
    assert out["sampling_rows"] == 4
    assert out["sampled_tokens_per_s"] > 0
    assert out["generate_tokens_per_s"] > 0
    assert set(out["ttft_s"]) == set(out["generate_ttft_s"]) == {"1", "2"}
    assert "Tinker primitives through the SDK" in table


def test_bench_prefix_times_both_generators_and_compares_their_answers(tmp_path):
    """On the tiny Llama: both cases for both generators, the kept one reusing the shared
    system prompt (and the conversation so far), the other nothing; every greedy answer
    the same; a bad option a clear error."""
    model = make_tiny_llama(tmp_path / "m")
    args = ["bench", "prefix", str(model), "--rounds", "1", "--questions", "3", "--turns", "2"]
    got, out = invoke([*args, "--system-tokens", "40", "--json"])
    assert got["bench"] == "prefix"
    cases = {(c["case"], c["cache"]): c for c in got["cases"]}
    assert set(cases) == {(c, k) for c in ("system", "together", "turns") for k in ("kept", "none")}
    assert cases[("system", "kept")]["cached_tokens_p50"] >= 40
    assert cases[("turns", "kept")]["cached_tokens_p50"] >= 40
    assert cases[("together", "kept")]["cached_tokens_p50"] >= 40
    assert cases[("system", "none")]["cached_tokens_p50"] == 0
    assert got["same_tokens"] == {"system": "3/3", "together": "3/3", "turns": "2/2"}
    assert got["ttft_ratio_system"] > 0
    assert "same greedy tokens" in out
    bad = runner.invoke(app, [*args, "--questions", "1"])
    assert bad.exit_code != 0
    assert "--questions" in bad.output
