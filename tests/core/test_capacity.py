"""The capacity planner (`pstar_core.capacity`, `pstar plan --gpus/--largest`) for hardware
that is not here: the paper's four configurations next to the paper's own answers, the
arithmetic of placement and overflow, and a plan of the paper's 68B in seconds."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import pytest

from benchmarks.plan_check import PAPER_CASES, paper_case
from pstar_core.capacity import PAPER_FAMILY, GiB, Hardware, Workload, plan_capacity
from pstar_core.forecast import Rates


@pytest.mark.parametrize("case", PAPER_CASES, ids=[c[0] for c in PAPER_CASES])
def test_the_paper_configurations_next_to_the_papers_answers(case):
    """Where memory bounded the paper, the planner's largest model is within one step of
    the family of the paper's; where the paper stopped at its throughput bar (its 1-GPU
    maxima), memory allows at least as much less one step."""
    got = paper_case(case)
    print(f"{got['case']}: planner {got['planner']}, paper {got['paper']} ({got['bounded_by']})")
    assert got["within_one_step"], got
    ours, theirs = PAPER_FAMILY.index(got["planner"]), PAPER_FAMILY.index(got["paper"])
    if got["bounded_by"] == "memory":
        assert abs(ours - theirs) <= 1
    if got["next_model"]:
        assert got["next_why"]  # the next one's reason is given


def test_a_rank_overflows_host_by_what_its_model_data_exceeds_and_disk_mends_it():
    hw = Hardware(8, 32 * GiB, 240 * GiB)
    p = plan_capacity("gpt-18b", hw)
    assert not p.fits
    assert p.overflow["host+disk"] == p.model_data_bytes - 240 * GiB // 8
    # at start the device's warm-up share holds some param chunks; no tier holds the rest
    on_device = sum(row["device"] for row in p.at_start.values())
    assert 0 < on_device <= 0.2 * p.device_bytes
    assert sum(row["over"] for row in p.at_start.values()) == p.overflow["host+disk"] - on_device
    assert "warm-up" in p.why
    mended = plan_capacity("gpt-18b", Hardware(8, 32 * GiB, 240 * GiB, disk_bytes=64 * GiB))
    assert mended.fits
    # at start the device's share takes what the host cannot hold; disk is for warm-up
    assert sum(row["device"] for row in mended.at_start.values()) == p.overflow["host+disk"]
    assert sum(row["over"] for row in mended.at_start.values()) == 0


def test_model_data_is_fourteen_bytes_a_parameter_shared_over_the_ranks():
    one = plan_capacity("gpt-10b", Hardware(1, 40 * GiB, 1024 * GiB))
    eight = plan_capacity("gpt-10b", Hardware(8, 40 * GiB, 1024 * GiB))
    assert 14 <= one.model_data_bytes / one.params < 14 / 0.95  # chunk ends cost < 5%
    assert eight.model_data_bytes * 8 == pytest.approx(one.model_data_bytes, rel=0.1)
    assert one.collective_bytes_per_iter == 0
    # all-gathers in forward and backward and a reduce-scatter, 7/8 of the fp16 list each
    assert eight.collective_bytes_per_iter == pytest.approx(
        3 * 7 / 8 * eight.lists["param"] * 8, rel=0.01
    )


def test_a_batch_too_large_for_the_gpu_overflows_the_device_and_checkpointing_helps():
    hw = Hardware(1, 16 * GiB, 1024 * GiB)
    big = plan_capacity("gpt-4b", hw, Workload(batch=16, activation_checkpointing=False))
    assert "device" in big.overflow
    assert "batch" in big.why
    small = plan_capacity("gpt-4b", hw, Workload(batch=16, activation_checkpointing=True))
    assert small.non_model_peak_bytes < big.non_model_peak_bytes / 5
    assert "device" not in small.overflow


def test_the_gpu_margin_holds_optimizer_states_when_the_model_leaves_room():
    p = plan_capacity("gpt-1b", Hardware(1, 80 * GiB, 512 * GiB), Workload(batch=4))
    assert p.gpu_margin_bytes > 0
    assert 0 < p.os_chunks_on_gpu <= p.os_chunks
    tight = plan_capacity("gpt-30b", Hardware(1, 40 * GiB, 1024 * GiB), Workload(batch=4))
    assert tight.gpu_margin_bytes < 0
    assert tight.os_chunks_on_gpu == 0


def test_pstar_plan_largest_prints_the_model_and_its_json_has_the_keys():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pstar", "plan", "--largest", "--gpus", "8",
         "--gpu-memory", "40", "--host-memory", "1024", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert time.monotonic() - t0 < 60  # the paper's 68B planned without allocating
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["largest_model"] == "gpt-68b"
    assert got["params"] > 66e9


def test_the_activation_model_is_within_its_stated_error_of_the_shipped_tracer_runs():
    """24 measured steps of gpt-small and gpt-45m (fp32: batch 2/8, seq 32/128; bf16: batch
    8, seq 128/256; checkpointing on and off): median 0.13% and largest 1.6% here; under
    1% and 5% asserted (the tiny preset is left out: its peak is mostly what no formula of
    the model's shape sees)."""
    from benchmarks.plan_check import calibration_error

    err = calibration_error()
    assert err["points"] == 24
    assert err["median"] < 0.01
    assert err["max"] < 0.05


def test_a_fresh_tracer_run_reproduces_a_shipped_calibration_point():
    from benchmarks.plan_check import CALIBRATION, measure_peak

    rows = json.loads(CALIBRATION.read_text())["rows"]
    [shipped] = [
        r
        for r in rows
        if (r["model"], r["ckpt"], r["batch"], r["seq"], r["dtype"])
        == ("gpt-small", False, 8, 128, "fp32")
    ]
    assert measure_peak("gpt-small", 8, 128, False) == pytest.approx(shipped["measured"], rel=0.05)


def test_the_chunk_search_uses_at_least_the_papers_share_of_chunk_memory():
    """The paper's chunk-size table: where it reports a utilization, this engine's search
    (embeddings in chunks) reaches at least as much; where it does not, more than 90% (the
    paper's "typical")."""
    from benchmarks.plan_check import chunk_table

    rows = chunk_table()
    assert [r["model"] for r in rows] == [
        "gpt-10b", "gpt-15b", "gpt-18b", "gpt-20b", "gpt-40b", "gpt-60b", "gpt-68b"
    ]  # fmt: skip
    for r in rows:
        assert r["utilization"] >= (r["paper_utilization"] or 0.90), r
        # each is planned for the size its name says
        assert abs(r["params"] / (int(r["model"][4:-1]) * 1e9) - 1) < 0.07


# -- the step time (issue 32, item 6) -------------------------------------------------

FAST = Rates(1e12, math.inf, math.inf, 1e9)


def _forecast(model: str, rates: Rates, device_gib: float = 40, batch: int = 8):
    from pstar_core.capacity import tensors_forecast, zoo_tensors
    from pstar_core.mapping import make_plan

    t = zoo_tensors(model)
    work = Workload(batch=batch)
    chunk = make_plan(t.numels, t.trainable, t.names, work.dtype, "auto").chunk_size
    return tensors_forecast(t, int(device_gib * GiB), 1, work, chunk, rates=rates), chunk


def test_the_model_flops_are_the_papers_count_with_recompute_as_a_forward():
    """8 FLOPs a parameter a token (forward, backward, recompute) and 16 x layers x hidden x
    sequence for attention, as the paper counts its TFLOPS; the zoo's `flops_per_token`
    (no recompute) is 6 and 12 of them."""
    from pstar_core.models import flops_per_token, get_config

    cfg = get_config("gpt-2b")
    f, _ = _forecast("gpt-2b", FAST)
    tokens = 8 * cfg.seq_len
    without_recompute = flops_per_token(cfg) * tokens
    assert f.flops == pytest.approx(without_recompute * 8 / 6, rel=0.02)


def test_with_a_free_link_the_step_is_its_compute_and_its_adam():
    """Copies that cost nothing hide nothing: after backward (`step()`), the step is the
    operators' FLOPs at the compute rate and Adam on the host for each chunk the device
    has no room for. Beside backward (`backward_and_step`), that Adam overlaps backward:
    the step is shorter, and no shorter than either part alone."""
    from pstar_core.capacity import zoo_tensors
    from pstar_core.mapping import make_plan

    t = zoo_tensors("gpt-2b")
    chunks = make_plan(t.numels, t.trainable, t.names, "fp16", "auto").trainable.num_chunks
    after = dataclasses.replace(FAST, adam_beside_backward=False)
    f, chunk = _forecast("gpt-2b", after, device_gib=20)
    assert 0 < f.device_adam_chunks < chunks
    assert f.host_to_device_bytes > 0
    on_host = (chunks - f.device_adam_chunks) * chunk / FAST.host_adam_params_per_s
    assert f.compute_seconds == pytest.approx(f.flops / 1e12 + on_host, rel=1e-9)
    assert f.step_seconds == pytest.approx(f.compute_seconds, rel=1e-9)
    beside, _ = _forecast("gpt-2b", FAST, device_gib=20)
    assert beside.compute_seconds == pytest.approx(beside.step_seconds, rel=1e-9)  # link free
    assert max(f.flops / 1e12, on_host) * (1 - 1e-9) <= beside.step_seconds < f.step_seconds
    assert beside.phase_seconds["optimizer"] < f.phase_seconds["optimizer"]


def test_a_slow_link_bounds_the_step_by_the_bytes_it_carries():
    slow = Rates(1e12, 1e9, 1e9, 1e9)
    f, _ = _forecast("gpt-2b", slow, device_gib=8)
    assert f.host_to_device_bytes > 0
    assert f.step_seconds >= f.host_to_device_bytes / 1e9
    assert f.step_seconds >= f.device_to_host_bytes / 1e9
    assert f.step_seconds > f.compute_seconds
    faster, _ = _forecast("gpt-2b", Rates(1e12, 4e9, 4e9, 1e9), device_gib=8)
    assert faster.step_seconds < f.step_seconds
