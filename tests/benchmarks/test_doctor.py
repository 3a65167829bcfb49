"""`pstar doctor --gpu`: on a machine without a GPU it says so; its checks' own code runs
on the CPU (`--device cpu`), where the CUDA-only ones report a skip, never a pass."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from benchmarks import doctor
from pstar.cli import app
from pstar_core.models import get_config

runner = CliRunner()


@pytest.fixture
def tiny(monkeypatch):
    model = dataclasses.replace(get_config("gpt-tiny"), vocab_size=256)
    monkeypatch.setattr(doctor, "MODEL", model)
    monkeypatch.setattr(doctor, "SEQ", 32)
    monkeypatch.setattr(doctor, "CHUNK", 1 << 14)
    monkeypatch.setattr(doctor, "DTYPE", "fp32")
    monkeypatch.setattr(doctor, "ADAM_ELEMS", 1 << 20)


def test_without_a_gpu_doctor_says_so_and_exits_2():
    result = runner.invoke(app, ["doctor", "--gpu"])
    assert result.exit_code == 2
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["gpu"] is False
    assert "no CUDA device" in data["error"]


def test_doctor_needs_the_gpu_flag():
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    assert "--gpu" in result.output


def test_checks_run_on_the_cpu_and_claim_nothing_for_cuda(tiny):
    result = runner.invoke(app, ["doctor", "--gpu", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["failed"] == []
    assert set(data["passed"]) == {"placement", "budget"}
    checks = data["checks"]
    assert checks["budget"]["evicted_bytes"] > 0  # the budget really forced eviction
    assert checks["budget"]["chunk_peak"] <= checks["budget"]["budget"]
    for name in ("parity", "tracer", "mixed_adam", "pinned", "overlap", "nccl"):
        assert checks[name]["status"].startswith("skip"), name
    assert checks["adam"]["ours_GBps"] > 0


@pytest.mark.fakegpu
def test_on_a_device_with_a_gpus_capabilities_every_check_but_cudas_own_runs(tiny):
    """On the test suite's second device (streams, page-locked host memory, allocator
    statistics and a memory limit, an RNG) the GPU checks execute and pass: placement in
    the registered pool, parity with the CPU, the tracer's N_i against the allocator, the
    budget under a device limited to it (reserved memory within the limit), Adam on the
    device and on the host in the same steps; device Adam against torch ops runs and gives
    its numbers, but its speed bar is a GPU's (skip); CUDA's profiler (overlap) and two
    CUDA devices (nccl) skip."""
    from tests import fakedevice

    fakedevice.load()
    result = doctor.run(device="fakegpu")
    checks = result["checks"]
    assert result["failed"] == [], {k: v for k, v in checks.items() if v["status"] == "fail"}
    assert set(result["passed"]) == {
        "placement",
        "parity",
        "tracer",
        "budget",
        "mixed_adam",
        "pinned",
    }
    assert checks["adam"]["status"].startswith("skip (not CUDA")
    assert checks["adam"]["ours_GBps"] > 0
    assert checks["budget"]["reserved_peak"] <= checks["budget"]["limit"]
    mixed = checks["mixed_adam"]
    assert 0 < mixed["device_adam_chunks"] < mixed["own_chunks"]
    assert mixed["reserved_peak"] <= mixed["limit"]
    assert checks["budget"]["evicted_bytes"] > 0
    assert checks["pinned"]["outside_pool"] == 0
    assert checks["pinned"]["host_chunks"] > 0  # the check had chunks to look at
    assert checks["overlap"]["status"].startswith("skip")
    assert checks["nccl"]["status"].startswith("skip")
    assert result["capabilities"]["streams"]
    assert result["capabilities"]["pinned_host"]


def test_a_check_that_runs_past_its_limit_fails_instead_of_hanging(tiny, monkeypatch):
    import time as _time

    def hangs(device):
        _time.sleep(30)

    monkeypatch.setattr(doctor, "CHECKS", (hangs,))
    monkeypatch.setattr(doctor, "CHECK_SECONDS", 1)
    result = doctor.run(device="cpu")
    assert result["failed"] == ["hangs"]
    assert "past its 1 s limit" in result["checks"]["hangs"]["detail"]


def test_a_crashing_check_is_a_failure_with_its_reason(tiny, monkeypatch):
    def broken(device):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(doctor, "CHECKS", (broken,))
    result = doctor.run(device="cpu")
    assert result["failed"] == ["broken"]
    assert "device on fire" in result["checks"]["broken"]["detail"]
