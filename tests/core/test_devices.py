"""Device discipline on a machine without a GPU: what a GPU would refuse fails here too, and
the engine keeps to the rules (see [Note: device discipline] in pstar_core/devices.py)."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from pstar_core.devices import DeviceDisciplineError, check, resolve_device, to_device
from pstar_core.tiers import SpillFile
from pstar_core.zero import ZeroGroup
from tests.core.helpers import MODELS, batches, engine_config, reference_model, run_engine

META = torch.device("meta")  # a device that is not the host, with no GPU needed


def test_a_violation_names_what_and_where_and_costs_nothing_when_off(monkeypatch):
    with pytest.raises(DeviceDisciplineError, match=r"the rule \(at .*test_devices\.py:\d+"):
        check(False, "the rule")
    monkeypatch.setenv("PSTAR_DEVICE_CHECKS", "0")
    check(False, "ignored when off")


def test_a_collective_handed_a_host_tensor_on_a_device_rank_is_refused():
    zero = ZeroGroup(None, 0, 2, device=META)
    with pytest.raises(DeviceDisciplineError, match="all_gather handed a tensor on cpu"):
        zero._sent("all_gather", torch.ones(4), 1)
    zero._sent("all_gather", torch.empty(4, device=META), 1)  # on the device: fine
    assert zero.bytes_sent == 16


def test_the_spill_file_reads_and_writes_host_memory_only(tmp_path):
    spill = SpillFile(tmp_path)
    with pytest.raises(DeviceDisciplineError, match="meta tensor is read as NumPy"):
        spill.write(torch.empty(8, device=META))
    offset = spill.write(torch.arange(8.0))
    with pytest.raises(DeviceDisciplineError, match="read into a meta tensor"):
        spill.read(offset, torch.empty(8, device=META))
    back = torch.empty(8)
    spill.read(offset, back)
    assert back.tolist() == list(range(8))
    spill.close()


def test_the_engine_moves_a_batch_to_its_device_itself():
    x = {"input_ids": torch.ones(2, 3, dtype=torch.long), "note": "kept"}
    moved = to_device(((x["input_ids"],), x), META)
    assert moved[0][0].device == META
    assert moved[1]["input_ids"].device == META
    assert moved[1]["note"] == "kept"


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_spilled_chunk_goes_to_the_device_through_the_host(tmp_path):
    memory = {
        "device_budget": 1_500_000,
        "host_budget": 1_000_000,
        "disk_budget": 20 << 20,
        "disk_dir": str(tmp_path),
    }
    ref = reference_model(MODELS["gpt"])
    engine = pstar_core.initialize(lambda: ref, engine_config(chunk_size=16384, memory=memory))
    run_engine(engine, batches(2))
    r = engine.manager.residency
    moves = r.transfers.bytes_moved
    spilled = next(c for c in engine.manager.chunks() if c.tier == "disk")
    before = dict(moves)
    r.make_resident([spilled], "device")
    moved = {k: v - before.get(k, 0) for k, v in moves.items() if v != before.get(k, 0)}
    assert spilled.tier == "device"
    assert moved.get("disk->host", 0) >= spilled.nbytes
    assert moved.get("host->device", 0) >= spilled.nbytes
    assert "disk->device" not in moves
    assert "device->disk" not in moves  # evictions from the device stop at the host


@pytest.fixture
def threads():
    """torch's thread count, restored after the test (it is process-wide)."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_under_torchrun_host_adam_gets_the_ranks_share_of_the_cores(monkeypatch, threads):
    """torchrun sets OMP_NUM_THREADS=1 for every rank of a multi-rank node: the engine
    then gives each rank its share of the cores it may run on, so host Adam does not run
    on one core; PSTAR_HOST_THREADS sets the count outright, and without torchrun's
    marks torch's own setting stands."""
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("PSTAR_HOST_THREADS", raising=False)
    torch.set_num_threads(1)
    engine = pstar_core.initialize(MODELS["gpt"], engine_config())
    assert torch.get_num_threads() == cores
    assert engine.stats()["threads"] == cores
    engine.close()
    monkeypatch.setenv("PSTAR_HOST_THREADS", "3")
    torch.set_num_threads(1)
    pstar_core.initialize(MODELS["gpt"], engine_config()).close()
    assert torch.get_num_threads() == 3
    monkeypatch.delenv("PSTAR_HOST_THREADS")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # one thread asked for outside torchrun
    torch.set_num_threads(1)
    pstar_core.initialize(MODELS["gpt"], engine_config()).close()
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("PSTAR_HOST_THREADS", "many")
    with pytest.raises(ValueError, match="PSTAR_HOST_THREADS must be a positive integer"):
        pstar_core.initialize(MODELS["gpt"], engine_config())
