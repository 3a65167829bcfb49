"""`pstar doctor --gpu`: on a machine without a GPU it says so; its checks' own code runs
on the CPU (`--device cpu`), where the CUDA-only ones report a skip, never a pass."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from benchmarks import doctor
from pstar_core.models import get_config
from service.cli import app

runner = CliRunner()


@pytest.fixture
def tiny(monkeypatch):
    model = dataclasses.replace(get_config("gpt-tiny"), vocab_size=256)
    monkeypatch.setattr(doctor, "MODEL", model)
    monkeypatch.setattr(doctor, "SEQ", 32)
    monkeypatch.setattr(doctor, "CHUNK", 1 << 14)


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
    for name in ("parity", "tracer", "pinned", "overlap", "nccl"):
        assert checks[name]["status"].startswith("skip"), name
    assert checks["adam"]["ours_GBps"] > 0


def test_a_crashing_check_is_a_failure_with_its_reason(tiny, monkeypatch):
    def broken(device):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(doctor, "CHECKS", (broken,))
    result = doctor.run(device="cpu")
    assert result["failed"] == ["broken"]
    assert "device on fire" in result["checks"]["broken"]["detail"]
