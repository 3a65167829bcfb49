"""What happens around training: an iteration that fails, an engine that is closed, spill
files that must not outlive the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pstar_core
from pstar_core.chunk import TensorState
from pstar_core.tracer import Mode
from tests.core.helpers import MODELS, VOCAB, batches, engine_config, reference_model, run_engine

ROOT = Path(__file__).resolve().parents[2]


def _profiler_on() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def run_script(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def fresh(**cfg):
    ref = reference_model(MODELS["gpt"])
    return pstar_core.initialize(lambda: ref, engine_config(**cfg))


def test_an_error_raised_by_user_code_in_the_warm_up_exits_with_that_error_and_code_1():
    script = textwrap.dedent(
        """
        import pstar_core
        from tests.core.helpers import MODELS, batches, engine_config
        engine = pstar_core.initialize(MODELS["gpt"], engine_config())
        x = batches(1)[0]
        loss = engine(input_ids=x, labels=x).loss  # the warm-up trace is being recorded
        raise RuntimeError("bad batch from the user's data loader")
        """
    )
    out = run_script(script)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "RuntimeError: bad batch from the user's data loader" in out.stderr


def test_an_error_inside_the_warm_up_abandons_it_and_the_next_iteration_traces_again():
    data = batches(3)
    expected = run_engine(fresh(), data)
    engine = fresh()
    bad = torch.full_like(data[0], VOCAB + 5)  # out of the embedding's range
    with pytest.raises(IndexError):
        engine(input_ids=bad, labels=bad)
    tracer = engine.manager.tracer
    assert (tracer.mode, tracer.trace) == (Mode.IDLE, None)
    assert not _profiler_on()
    assert all(s.state is TensorState.HOLD for s in engine.slots.values())
    # the engine goes on as if the failed batch had never been tried
    assert run_engine(engine, data) == expected
    assert engine.stats()["tracer"]["moments"] > 0


def test_abandon_iteration_drops_the_gradients_of_a_failed_step():
    data = batches(3)
    expected = run_engine(fresh(), data)
    engine = fresh()
    for x in data[:1]:  # the first step, then a micro-batch the user's code gives up on
        run_engine(engine, [x])
    x = data[1]
    engine.backward(engine(input_ids=x, labels=x).loss * 1000)
    engine.abandon_iteration()
    assert all(s.state is TensorState.HOLD for s in engine.slots.values())
    assert run_engine(engine, data[1:]) == expected[1:]


def test_close_frees_every_tier_and_the_engine_refuses_further_use(tmp_path):
    memory = {"device_budget": 1_500_000, "disk_budget": 10 << 20, "disk_dir": str(tmp_path)}
    with fresh(chunk_size=16384, memory=memory) as engine:
        x = batches(1)[0]
        engine.backward(engine(input_ids=x, labels=x).loss)  # closed mid-iteration
        assert sum(t["used"] for t in engine.stats()["tiers"].values()) > 0
    assert all(t["used"] == 0 for t in engine.manager.residency.tier_bytes().values())
    assert all(c.payload is None for c in engine.manager.chunks())
    assert not _profiler_on()
    with pytest.raises(RuntimeError, match="closed"):
        engine(input_ids=x, labels=x)
    engine.close()  # twice is harmless


def test_spilled_chunks_live_in_an_unlinked_file_that_gives_space_back(tmp_path):
    host = 1_000_000  # forces chunks of all lists to disk
    memory = {
        "device_budget": 1_500_000,
        "host_budget": host,
        "disk_budget": 20 << 20,
        "disk_dir": str(tmp_path / "spill"),
    }
    data = batches(2)
    expected = run_engine(fresh(chunk_size=16384), data)
    engine = fresh(chunk_size=16384, memory=memory)
    assert run_engine(engine, data) == expected
    disk = engine.manager.residency.tiers["disk"]
    assert disk.used_bytes > 0
    assert list((tmp_path / "spill").iterdir()) == []  # nothing with a name: no leftovers
    spill = disk.spill
    # chunks went back and forth; the file's blocks are the chunks it holds now (a chunk
    # read back gives its blocks back), not all it ever held
    assert spill.high_water_bytes() > disk.used_bytes
    assert disk.used_bytes <= spill.disk_bytes() <= disk.used_bytes + 64 * 1024
    engine.close()
    assert disk.spill is None


def test_a_killed_process_leaves_no_spill_file(tmp_path):
    spill = tmp_path / "spill"
    script = textwrap.dedent(
        f"""
        import os, signal
        import pstar_core
        from tests.core.helpers import MODELS, batches, engine_config, run_engine
        memory = {{"device_budget": 1_500_000, "host_budget": 1_000_000,
                  "disk_budget": 20 << 20, "disk_dir": {str(spill)!r}}}
        engine = pstar_core.initialize(MODELS["gpt"], engine_config(chunk_size=16384,
                                       memory=memory))
        run_engine(engine, batches(1))
        assert engine.manager.residency.tiers["disk"].used_bytes > 0
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = run_script(script)
    assert out.returncode == -9, out.stderr[-2000:]
    assert list(spill.iterdir()) == []


def test_a_profiler_trace_names_the_engines_phases():
    engine = fresh(chunk_size=16384, memory={"device_budget": 1_500_000})
    data = batches(3)
    run_engine(engine, data[:2])  # warm-up, then a steady iteration
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_engine(engine, data[2:])
    names = {e.name for e in prof.events()}
    assert {"pstar::access", "pstar::adam"} <= names
    assert "pstar::move host->device" in names  # the budget makes chunks come and go


def test_optimizer_states_take_memory_only_from_their_first_step():
    engine = fresh(chunk_size=16384)
    st = engine.stats()
    params, masters = st["chunks"]["param"]["bytes"], st["chunks"]["param_fp32"]["bytes"]
    held = sum(t["used"] for t in st["tiers"].values())
    assert held == params + masters  # 6 bytes per parameter in bf16, 8 in fp32 (here)
    assert st["chunks"]["momentum"]["by_tier"] == {}
    run_engine(engine, batches(1))
    st = engine.stats()
    held = sum(t["used"] for t in st["tiers"].values())
    assert held == st["chunk_bytes"]  # momentum and variance exist now, zeros updated once
    assert sum(st["chunks"]["variance"]["by_tier"].values()) == st["chunks"]["variance"]["count"]
