"""The engine on a second device: forward, backward and Adam through access/release with
the device tier on `fakegpu` (a device distinct from the host, see `tests.fakedevice`),
against the same run with the CPU as the device. What a GPU would refuse fails here too:
a host tensor in a device op, a device tensor read as NumPy, a host tensor handed to the
NCCL-like backend."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from tests import fakedevice
from tests.core.helpers import MODELS, batches, engine_config, reference_model, run_engine

DEV = "fakegpu"
CHUNK = 16384


@pytest.fixture(scope="module", autouse=True)
def fake():
    return fakedevice.load()


def make(name: str, device: str, memory: dict | None = None, dtype: str = "fp32"):
    ref = reference_model(MODELS[name])
    cfg = engine_config(dtype=dtype, chunk_size=CHUNK, device=device, memory=memory or {})
    engine = pstar_core.initialize(MODELS[name], cfg)
    engine.load_state_dict(ref.state_dict())
    return engine


def tiers_of(engine) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for c in engine.manager.chunks():
        if c.payload is not None:
            out.setdefault(c.tier, set()).add(c.payload.device.type)
    return out


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_on_the_second_device_equals_the_cpu_as_device(name, dtype):
    data = batches(4)
    on_cpu = run_engine(make(name, "cpu", dtype=dtype), data)
    engine = make(name, DEV, dtype=dtype)
    # the batches are CPU tensors: the engine moves them (a GPU would refuse them)
    on_dev = run_engine(engine, data)
    # forward and backward run the same kernels; Adam on the device is torch's fused one,
    # whose last-bit differences from the C++ kernel can flip a bf16 rounding
    rtol = 1e-5 if dtype == "fp32" else 2e-4
    torch.testing.assert_close(torch.tensor(on_dev), torch.tensor(on_cpu), rtol=rtol, atol=0)
    tiers = tiers_of(engine)
    assert tiers["device"] == {DEV}
    assert tiers.get("host", {"cpu"}) == {"cpu"}
    assert engine.stats()["device_adam_chunks"] > 0  # Adam ran on the device tier too
    engine.close()


def test_tracer_reads_the_device_allocator_and_budgets_evict(fake):
    probe = make("gpt", DEV)
    run_engine(probe, batches(1))
    st = probe.stats()
    probe.close()
    n = st["tracer"]["peak_non_model_bytes"]
    assert n > 0  # measured from the device's allocator peaks, minus chunk bytes
    budget = int(n + 0.4 * st["chunks"]["param"]["bytes"])
    data = batches(4)
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data)
    fake.reset_peak_memory_stats()
    before = fake.memory_allocated()
    engine = make("gpt", DEV, {"device_budget": budget})
    on_dev = run_engine(engine, data)
    torch.testing.assert_close(torch.tensor(on_dev), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    moved = engine.stats()["bytes_moved"]
    assert moved["device->host"] > 0
    assert moved["host->device"] > 0
    # the device's own count of bytes stays within the budget, device Adam's fp32
    # gradient buffer included (reserved in N_j at its moments by placement)
    peak = fake.max_memory_allocated() - before
    assert peak <= budget, (peak, budget)
    engine.close()


def _forward_backward_peak(stats) -> int:
    names, non_model = stats["tracer"]["names"], stats["tracer"]["non_model_bytes"]
    return max(n for name, n in zip(names, non_model, strict=True) if not name.startswith("adam."))


def test_device_adam_and_accumulation_stay_within_the_device_budget(fake):
    """Room for three chunks' optimizer states on the device, gradients accumulated over
    two micro-batches (accum chunks on the device too): Adam's fp32 gradient buffer is
    reserved at its moments, so the device's own byte count never passes the budget
    (without the reserve it did, by 6 KB here), and accumulating gradients on a device
    points every parameter at device memory (it once left one on the host)."""
    probe = make("gpt", DEV)
    run_engine(probe, batches(1), micro_batches=2)
    st = probe.stats()
    probe.close()
    triple, temporary = 12 * CHUNK, 4 * CHUNK + 4096
    budget = _forward_backward_peak(st) + st["chunks"]["param"]["bytes"] + 3 * triple
    budget += temporary + 1000
    data = batches(4)
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data, micro_batches=2)
    fake.reset_peak_memory_stats()
    before = fake.memory_allocated()
    engine = make("gpt", DEV, {"device_budget": budget})
    on_dev = run_engine(engine, data, micro_batches=2)
    peak = fake.max_memory_allocated() - before
    torch.testing.assert_close(torch.tensor(on_dev), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    assert engine.stats()["device_adam_chunks"] >= 3
    assert engine.stats()["peak_grad_accum_bytes"] > 0
    assert peak <= budget, (peak, budget)
    engine.close()


def test_disk_tier_with_the_second_device_never_reads_device_memory(tmp_path):
    # the spill file reads and writes host memory only: a device chunk going to disk
    # passes through the host, and .numpy() on a fakegpu tensor would raise here
    probe = make("gpt", DEV)
    chunk_bytes = probe.stats()["chunk_bytes"]
    n = probe.stats()["tracer"]["peak_non_model_bytes"]
    probe.close()
    memory = {
        "device_budget": max(n, 1) + chunk_bytes // 3,
        "host_budget": chunk_bytes // 3,
        "disk_budget": 4 * chunk_bytes,
        "disk_dir": str(tmp_path),
    }
    data = batches(3)
    on_cpu = run_engine(make("gpt", "cpu", memory), data)
    engine = make("gpt", DEV, memory)
    on_dev = run_engine(engine, data)
    torch.testing.assert_close(torch.tensor(on_dev), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    moved = engine.stats()["bytes_moved"]
    assert moved["host->disk"] > 0
    assert "device->disk" not in moved
    assert "disk->device" not in moved
    engine.close()


def test_state_dict_and_checkpoint_from_the_second_device(tmp_path):
    engine = make("gpt", DEV)
    run_engine(engine, batches(2))
    sd = engine.state_dict()
    assert all(t.device.type == "cpu" for t in sd.values())
    engine.save_checkpoint(tmp_path / "ckpt")
    again = make("gpt", DEV)
    again.load_checkpoint(tmp_path / "ckpt")
    assert run_engine(again, batches(2, seed=3)) == run_engine(engine, batches(2, seed=3))
    for e in (engine, again):
        e.close()


def test_zero_on_two_ranks_of_the_second_device_equals_one_cpu_rank(tmp_path):
    # collectives on device tensors through an NCCL-like backend that refuses host ones:
    # gathers, overlapped reduce-scatters, the clipping/loss all-reduces, export's
    # broadcasts all have to hand it device memory
    from tests.core.helpers import spawn_ranks

    def launch(name, world, where, **env):
        return spawn_ranks("tests.core.zero_worker", world, tmp_path / where, name, **env)

    clip = {"PSTAR_TEST_CLIP": "0.5"}  # the norm's all-reduce runs every step
    single = launch("train", 1, "cpu", **clip)[0]
    ranks = launch("train", 2, "dev", PSTAR_TEST_DEVICE=DEV, **clip)
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0
    )
    assert ranks[0]["overlapped"] > 0  # on a device, reductions overlap by default
    exported = launch("export", 2, "export", PSTAR_TEST_DEVICE=DEV)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "hf")
    with torch.no_grad():
        logits = model(input_ids=batches(1, seed=9)[0]).logits
    expected = torch.tensor(exported[0]["logits"])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
