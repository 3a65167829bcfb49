"""`dtype: auto`: the compute dtype follows what the device computes fast (precision.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import pstar_core
from pstar_core import precision
from pstar_core.checkpoint import load_checkpoint
from pstar_core.config import EngineConfig
from tests.core.helpers import MODELS, ROOT, batches, engine_config, run_engine

CPU = torch.device("cpu")


def _no_probe(*_a, **_k):
    raise AssertionError("the probe ran although the flags settle it")


def test_auto_is_the_default():
    assert EngineConfig().dtype == "auto"


def test_a_cpu_whose_flags_lack_bf16_computes_in_fp32_without_probing(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags_promise_bf16", lambda: False)
    monkeypatch.setattr(precision, "probe_cpu", _no_probe)
    p = precision.decide("auto", CPU)
    assert p.dtype == "fp32"
    assert not p.native_bf16
    assert "no native bf16" in p.reason


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ({"fp32": 90.0, "bf16": 200.0, "fp16": 3.0}, "bf16"),
        ({"fp32": 90.0, "bf16": 3.0, "fp16": 3.0}, "fp32"),  # flags promise, oneDNN capped
    ],
)
def test_the_probe_decides_where_the_flags_promise_bf16(monkeypatch, rates, expected):
    monkeypatch.setattr(precision, "cpu_flags_promise_bf16", lambda: True)
    monkeypatch.setattr(precision, "probe_cpu", lambda threads, names: rates)
    p = precision.decide("auto", CPU)
    assert p.dtype == expected
    assert p.probe_gflops == rates
    assert f"{rates['bf16']:.0f}" in p.reason or f"{rates['bf16']:.1f}" in p.reason


def test_the_probe_measures_this_cpu():
    rates = precision.probe_cpu(torch.get_num_threads(), ("fp32", "bf16", "fp16"))
    assert set(rates) == {"fp32", "bf16", "fp16"}
    assert all(r > 0 for r in rates.values())


def test_explicit_bf16_on_a_slow_cpu_runs_with_one_warning_saying_how_much_slower(
    monkeypatch, caplog
):
    monkeypatch.setattr(precision, "cpu_flags_promise_bf16", lambda: False)
    monkeypatch.setattr(
        precision, "probe_cpu", lambda t, n: {"fp32": 90.0, "bf16": 3.0, "fp16": 3.0}
    )
    with caplog.at_level(logging.WARNING, logger="pstar_core.precision"):
        engine = pstar_core.initialize(MODELS["gpt"], engine_config("bf16"))
    assert engine.stats()["compute_dtype"] == "bf16"
    assert engine.manager.lists[pstar_core.chunk.ChunkType.PARAM][0].dtype == torch.bfloat16
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("pstar_core")
    ]
    assert len(warnings) == 1, warnings
    assert "30x slower" in warnings[0]
    assert "'auto'" in warnings[0]
    engine.close()


def test_auto_engine_computes_in_what_the_machine_decides():
    engine = pstar_core.initialize(MODELS["gpt"], engine_config("auto"))
    st = engine.stats()
    expected = precision.decide("auto", CPU)
    assert st["compute_dtype"] == expected.dtype == st["precision"]["dtype"]
    assert st["precision"]["requested"] == "auto"
    assert st["precision"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    kind = pstar_core.chunk.ChunkType.PARAM
    assert (
        engine.manager.lists[kind][0].dtype
        == precision.Precision("auto", expected.dtype, "", "", False).torch_dtype
    )
    losses = run_engine(engine, batches(2))
    assert all(torch.isfinite(torch.tensor(losses)))
    engine.close()


def test_a_cpu_that_computes_bf16_slowly_gets_fp32():
    """A real CPU without fast bf16: torch and oneDNN held to AVX2 (as on most laptops);
    on a machine that is AVX2 already this is the machine itself."""
    code = (
        "import json, torch; from pstar_core import precision; "
        "p = precision.decide('auto', torch.device('cpu')); print(json.dumps(p.as_dict()))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    p = json.loads(out.stdout.strip().splitlines()[-1])
    assert p["dtype"] == "fp32", p
    assert p["cpu_capability"] == "AVX2"


def test_planned_dtype_sizes_gpu_jobs_in_two_bytes():
    assert precision.planned_dtype("auto", accelerator=True) == "bf16"
    assert precision.planned_dtype("fp32", accelerator=True) == "fp32"
    assert precision.planned_dtype("auto", accelerator=False) == precision.decide("auto", CPU).dtype


def test_a_bf16_checkpoint_resumes_in_fp32_from_the_same_masters(tmp_path):
    """A job resumed on a CPU without bf16 continues in fp32: the param chunks are
    re-derived from the fp32 masters, which the checkpoint holds exactly."""
    data = batches(6)
    first = pstar_core.initialize(MODELS["gpt"], engine_config("bf16"))
    run_engine(first, data[:3])
    first.save_checkpoint(tmp_path / "ck")
    masters = first.state_dict()
    first.close()
    resumed = pstar_core.initialize(MODELS["gpt"], engine_config("fp32"))
    load_checkpoint(resumed, tmp_path / "ck")
    assert resumed.global_step == 3
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, masters[name]), name
    losses = run_engine(resumed, data[3:])
    assert all(torch.isfinite(torch.tensor(losses)))
    resumed.close()


def test_ranks_agree_on_the_most_conservative_dtype(tmp_path):
    """Rank 0 would pick bf16, rank 1 (a CPU without fast bf16) fp32: both compute in fp32,
    and rank 0 says why."""
    from tests.core.helpers import spawn_ranks

    ranks = spawn_ranks("tests.core.zero_worker", 2, tmp_path, "precision")
    assert [r["precision"]["dtype"] for r in ranks] == ["fp32", "fp32"]
    assert "another rank" in ranks[0]["precision"]["reason"]
