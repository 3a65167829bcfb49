"""`scripts/gpu_check.py`, the one-GPU acceptance run, on the test suite's second device:
every stage executes in a process of its own (small models), figures only a GPU gives say
"n/a", the report is written after every stage, and a stage that hangs is killed at its
limit instead of holding the run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
STAGES = ["env", "doctor", "budgets", "baselines", "resume", "nccl"]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "fakegpu", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=420,
    )
    return proc, out


@pytest.mark.fakegpu
def test_every_stage_runs_and_passes_on_the_fake_device(fake_run):
    proc, out = fake_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the result
    assert last["passed"] == STAGES, {k: v.get("detail") for k, v in last["stages"].items()}
    assert last["failed"] == []
    on_disk = json.loads((out / "gpu_check.json").read_text())
    assert list(on_disk["stages"]) == STAGES


@pytest.mark.fakegpu
def test_figures_only_a_gpu_gives_say_na_and_the_rest_are_measured(fake_run):
    report = json.loads((fake_run[1] / "gpu_check.json").read_text())
    env = report["stages"]["env"]["numbers"]
    for key in ("h2d_pinned_GBps", "d2h_pageable_GBps", "host_register_GBps"):
        assert env[key] == "n/a"
    assert env["api"]["dist.all_gather_into_tensor"] is True
    assert isinstance(env["adam_kernel"]["built"], bool)
    budgets = report["stages"]["budgets"]["numbers"]
    a, b = budgets["a_params_evicted"], budgets["b_adam_split"]
    assert a["evicted_in_fwd_bwd"] > 0  # params left the device in forward and backward
    assert a["device_adam_chunks"] == 0
    assert 0 < b["device_adam_chunks"] < b["own_chunks"]  # Adam on both tiers
    for run in (a, b):
        assert run["reserved_peak"] <= run["limit"]
        assert run["sampled_above_N_i"] == 0
        assert run["host_chunks_unpinned"] == 0
        assert run["tflops"] == "n/a"
        assert run["alloc_retries"] == "n/a"
    base = report["stages"]["baselines"]["numbers"]
    for name in ("plain_torch", "engine_no_budget", "fsdp2_cpu_offload"):
        assert base[name]["max_rel_loss_diff_vs_plain"] <= 2e-2
    resume = report["stages"]["resume"]["numbers"]
    assert resume["losses_resumed"] == resume["losses_straight"]
    assert resume["same_state"]
    assert resume["straight_repeats"]
    assert resume["same_device_adam"]
    # host Adam beside backward: the same states to the bit, chunks run beside it after the
    # warm-up (in the budgets stage too, to the bit on this deterministic device)
    assert resume["beside_repeats"]
    assert resume["beside_chunks_by_step"][0] == 0
    assert min(resume["beside_chunks_by_step"][1:]) > 0
    beside = budgets["a_adam_beside"]
    assert beside["losses"] == a["losses"]
    assert beside["adam_beside_backward_chunks"] > 0
    alternated = beside["alternated"]  # both ways timed in one process, by turns
    assert alternated["steps_each"] == 6
    assert alternated["plain_step_s"] > 0
    assert alternated["beside_step_s"] > 0
    assert budgets["beside_speedup_alternated"] == alternated["speedup"]
    probes = report["stages"]["nccl"]["numbers"]["probes"]
    assert set(probes.values()) == {"ok"}
    first = report["throughput"][0]
    assert first["run"] == "plain_torch"
    assert first["step_time_vs_plain"] == 1.0


@pytest.mark.fakegpu
def test_a_stage_past_its_limit_is_killed_and_reported(tmp_path, monkeypatch, capsys):
    gpu_check = load_script()
    monkeypatch.setitem(gpu_check.LIMITS, "env", 0.5)  # it cannot even import torch in time
    report = gpu_check.run_all("fakegpu", tmp_path, ["env", "nccl"], print_table=False)
    assert report["stages"]["env"]["status"] == "timeout"
    assert "limit" in report["stages"]["env"]["detail"]
    assert report["stages"]["nccl"]["status"] == "pass"  # the run went on
    assert report["failed"] == ["env"]
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["failed"] == ["env"]


def test_missing_modules_are_named_with_how_to_bring_them(monkeypatch, capsys, tmp_path):
    gpu_check = load_script()
    monkeypatch.setattr(gpu_check, "NEEDED", ("torch", "pstar_no_such_module"))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path)])
    assert gpu_check.main() == 2
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["missing"] == ["pstar_no_such_module"]
    assert "scripts/gpu_deps.sh" in result["error"]
    assert not (tmp_path / "gpu_check.json").exists()  # nothing ran


def test_the_resume_stage_names_the_first_step_and_chunk_two_runs_differ_in():
    from benchmarks.gpu_resume import first_difference

    def half(grads, states):
        return {"grads": [{}, {}, *grads], "states": [{}, {}, *states]}

    same = {"adam": "device", "param": "p", "param_fp32": "m", "momentum": "1", "variance": "2"}
    other = {**same, "adam": "host", "momentum": "x"}
    x = half([{"0": "g", "1": "h"}, {}], [{"0": same, "1": same}, {"0": same, "1": same}])
    assert first_difference(x, x) == "every chunk's states after every step both ran are the same"
    y = half([{"0": "g", "1": "h"}, {}], [{"0": same, "1": same}, {"0": same, "1": other}])
    where = "step 4, chunk 1 (Adam on device vs host)"
    assert first_difference(x, y) == f"{where}: momentum after the step"
    z = half([{"0": "g", "1": "k"}, {}], [{"0": same, "1": other}, {"0": same, "1": same}])
    assert first_difference(x, z) == "step 3, chunk 1 (Adam on device vs host): its gradient"
    # a state held on another tier is named; the steps before the resumed half's are compared
    # where both halves ran them
    moved = {**same, "param_fp32": "n", "param_fp32@": "host"}
    w = {"grads": [{}, {}, {}, {}], "states": [{"0": same}, {"0": moved}, {}, {}]}
    assert first_difference({**w, "states": [{"0": same}] * 2 + [{}, {}]}, w) == (
        "step 2, chunk 0 (Adam on device vs device): param_fp32 after the step "
        "(param_fp32 on None vs host)"
    )
    # memory no tensor lives in is not a difference in training
    tail = {**same, "param+unused": "junk"}
    t = half([{}, {}], [{"0": tail}, {"0": same}])
    assert first_difference(half([{}, {}], [{"0": same}, {"0": same}]), t) == (
        "every chunk's tensors are the same; only unused tails differ "
        "(step 3, chunk 0 (Adam on device vs device): param)"
    )


@pytest.mark.fakegpu
def test_the_opt_in_profile_stage_says_where_a_step_went(tmp_path):
    args = ["--device", "fakegpu", "--stages", "profile", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = json.loads(proc.stdout.strip().splitlines()[-1])["stages"]["profile"]
    assert stage["status"] == "pass", stage.get("output_tail")
    for budget in ("params_evicted", "params_evicted_beside"):
        run = stage["numbers"][budget]
        assert run["wall_s"] > 0
        assert run["cprofile_step_s"] > 0
        # the engine's own work is named: its operators' ranges and its Python
        assert any("pstar::access" in line for line in run["top_host"])
        assert any("pstar_core" in line for line in run["cprofile_top"])
    # under N + P/2 every chunk's Adam ran on the host, in both runs, and beside backward
    # only with backward_and_step
    for budget in ("params_evicted", "params_evicted_beside"):
        assert stage["numbers"][budget]["device_adam_chunks"] == 0
    assert stage["numbers"]["params_evicted"]["adam_beside_backward_chunks"] == 0
    assert stage["numbers"]["params_evicted_beside"]["adam_beside_backward_chunks"] > 0
