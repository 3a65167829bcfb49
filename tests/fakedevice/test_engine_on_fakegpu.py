"""The engine on a second device: forward, backward and Adam through access/release with
the device tier on `fakegpu` (a device distinct from the host, see `tests.fakedevice`),
against the same run with the CPU as the device. What a GPU would refuse fails here too:
a host tensor in a device op, a device tensor read as NumPy, a host tensor handed to the
NCCL-like backend."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from pstar_core.hf import load_causal_lm
from pstar_core.kernels import adam_temporary_bytes
from pstar_core.tiers import HostArena
from tests import fakedevice
from tests.core.helpers import MODELS, batches, engine_config, reference_model, run_engine

DEV = "fakegpu"
CHUNK = 16384


@pytest.fixture(scope="module", autouse=True)
def fake():
    return fakedevice.load()


def make(name: str, device: str, memory: dict | None = None, dtype: str = "fp32", **extra):
    ref = reference_model(MODELS[name])
    cfg = engine_config(dtype=dtype, chunk_size=CHUNK, device=device, memory=memory or {}, **extra)
    cfg["memory"].setdefault("prefetch_moments", 2)
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


def test_tensors_spanning_chunks_train_bitwise_the_same_and_within_the_budget(fake):
    """Chunks of 1024 elements: the embedding, head and MLP weights span chunks; each
    operator's contiguous copy is made on the device from pieces that arrive on the copy
    stream (the fake device's race checks are on), and counted in the tracer's N_j."""
    data = batches(3)
    plain = make("hf_llama", DEV)
    whole = run_engine(plain, data)
    plain.close()  # its device chunks would be memory carried into the later tests
    probe = make("hf_llama", DEV)
    run_engine(probe, batches(1))
    st = probe.stats()
    probe.close()
    budget = int(st["tracer"]["peak_non_model_bytes"] + 0.5 * st["chunks"]["param"]["bytes"])
    ref = reference_model(MODELS["hf_llama"])
    cfg = engine_config(chunk_size=1024, device=DEV, memory={"device_budget": budget})
    engine = pstar_core.initialize(MODELS["hf_llama"], cfg)
    engine.load_state_dict(ref.state_dict())
    assert "lm_head.weight" in {s.name for s in engine.spans.values()}
    fake.reset_peak_memory_stats()
    before = fake.memory_allocated()
    assert run_engine(engine, data) == whole
    assert engine.stats()["bytes_moved"]["device->host"] > 0
    assert fake.max_memory_allocated() - before <= budget
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
    # the room set aside at device Adam's moments (its kernel's temporaries) is reported
    # beside the measurements, and admission reads the larger of the two
    tracer = engine.stats()["tracer"]
    reserved = {int(j): v for j, v in tracer["reserved_non_model_bytes"].items()}
    engine.close()
    assert len(reserved) == engine.stats()["device_adam_chunks"]
    assert all(tracer["names"][j].startswith("adam.") for j in reserved)
    assert set(reserved.values()) == {adam_temporary_bytes(CHUNK, engine.device)}
    trace = engine.manager.tracer.trace
    for j, v in reserved.items():
        assert trace.non_model[j] == tracer["non_model_bytes"][j]  # the measurement
        assert trace.need(j) == max(trace.non_model[j], v)


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
    # the resumed engine's first step (a warm-up, its own trace not yet recorded) updates
    # each chunk where the run it continues did: torch's fused AdamW on the device and
    # the host kernel differ in the last bit on some CPUs (AVX2: 4.795984745 against
    # 4.795984268 at the second step when the warm-up ran Adam on the host), not on others
    assert engine.manager.device_adam
    assert again.manager.device_adam == engine.manager.device_adam
    assert run_engine(again, batches(2, seed=3)) == run_engine(engine, batches(2, seed=3))
    for e in (engine, again):
        e.close()


def test_a_resumed_run_keeps_the_placement_of_the_run_it_continues_while_it_fits(tmp_path):
    """Its own first trace would place Adam again, and a trace depends on the step traced
    (on an H200 the resumed warm-up found room for both chunks where the original run had
    placed one: the resumed run then updated a chunk with the other tier's kernel and was
    not the run it continued). Here the resumed run's first batch is smaller (less
    activation memory: room for more states), and the placement stays; a budget too
    small for it places again."""
    from benchmarks.doctor import budgets

    probe = make("gpt", DEV)
    run_engine(probe, batches(1))
    budget = budgets(probe.stats(), DEV)["adam_split"]
    probe.close()
    engine = make("gpt", DEV, {"device_budget": budget})
    run_engine(engine, batches(2))
    kept = set(engine.manager.device_adam)
    own = len(list(engine.manager.own_chunks([pstar_core.chunk.ChunkType.PARAM])))
    assert 0 < len(kept) < own
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()

    def resumed(device_budget: int, batch: int) -> set[int]:
        again = make("gpt", DEV, {"device_budget": device_budget})
        again.load_checkpoint(tmp_path / "ckpt")
        run_engine(again, batches(2, batch=batch, seed=3))
        placed = set(again.manager.device_adam)
        again.close()
        return placed

    fresh = make("gpt", DEV, {"device_budget": budget})
    run_engine(fresh, batches(1, batch=1, seed=3))
    assert len(fresh.manager.device_adam) > len(kept)  # a small batch's trace has room
    fresh.close()
    assert resumed(budget, batch=1) == kept
    assert resumed(budget + 10 * 2**20, batch=4) != kept  # a larger device places again


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
    assert ranks[0]["gathered_ahead"] > 0  # and the next group is gathered ahead
    # 'fakegpu' without an index: each rank its own device, from LOCAL_RANK
    assert [r["device"] for r in ranks] == [f"{DEV}:0", f"{DEV}:1"]
    # a group-sized all-gather (NCCL allocates its buffers at first use) before the
    # device budget is read from the free memory
    assert ranks[0]["order"] == ["all_gather", "budget"]
    # a torch before 2.13 (no all_gather_single / reduce_scatter_single): bitwise the same
    old = launch("train", 2, "old", PSTAR_TEST_DEVICE=DEV, PSTAR_TEST_OLD_TORCH="1", **clip)
    assert old[0]["collective_names"] == []
    assert old[0]["losses"] == ranks[0]["losses"]
    exported = launch("export", 2, "export", PSTAR_TEST_DEVICE=DEV)

    model = load_causal_lm(tmp_path / "export" / "hf")
    with torch.no_grad():
        logits = model(input_ids=batches(1, seed=9)[0]).logits
    expected = torch.tensor(exported[0]["logits"])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_cpu_rank(tmp_path_factory):
    """The ZeRO worker's training run on one CPU rank: what every split must equal."""
    from tests.core.helpers import spawn_ranks

    where = tmp_path_factory.mktemp("one")
    return spawn_ranks("tests.core.zero_worker", 1, where, "train")[0]


def test_zero_on_a_subgroup_is_made_by_its_members_alone(tmp_path, one_cpu_rank):
    """`process_group=` a 2-rank subgroup of 3 processes: the engine's flag group is made
    with local synchronization, so the third process never calls into it, the two train
    as one rank with their global batch, and groups made afterwards by every process
    still match (a flag group made without it shifted their names: 'Group rank ... is not
    part of group')."""
    from tests.core.helpers import spawn_ranks

    def launch(name, world, where, **env):
        return spawn_ranks(
            "tests.core.zero_worker", world, tmp_path / where, name, timeout=120, **env
        )

    single = one_cpu_rank
    ranks = launch("subgroup", 3, "three", PSTAR_TEST_DEVICE=DEV)
    assert [r["member"] for r in ranks] == [True, True, False]
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["losses"] == ranks[1]["losses"]
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"][:4]), rtol=1e-5, atol=0
    )
    assert ranks[1]["across"] == ranks[2]["across"] == 3.0


def test_a_group_settled_at_the_devices_limit_allocates_nothing_there(tmp_path, one_cpu_rank):
    """When the device is full and nothing can be evicted, `Residency.reserve` waits for
    the reductions in flight to free their group buffers. Leaving a buffer used to copy
    the own chunk into a new device chunk first (one chunk past the limit, where a real
    allocator runs out of memory); settled under pressure, the own chunk goes to the host
    instead. Here every reduction in flight in backward is settled that way: the device
    never grows during a settle, chunks were evicted so, and the losses are unchanged."""
    from tests.core.helpers import spawn_ranks

    ranks = spawn_ranks("tests.core.zero_worker", 2, tmp_path, "pressed", PSTAR_TEST_DEVICE=DEV)
    for r in ranks:
        assert r["evicted"] > 0
        assert r["grown"]
        assert max(r["grown"]) <= 0, r["grown"]
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]),
        torch.tensor(one_cpu_rank["losses"][:4]),
        rtol=1e-5,
        atol=0,
    )


@pytest.mark.parametrize("at", [2, 3], ids=["flagged", "agreed"])
def test_an_out_of_memory_in_one_ranks_gather_fails_both_ranks_at_once(tmp_path, at):
    """Rank 1 runs out of device memory allocating a gather's group buffer. It is
    allocated before the collective's flag, so rank 0 learns of it there and raises
    `RankFailed` at once, instead of waiting in an all-gather rank 1 never issues (which
    hung until the collective timed out). In a section on its agreed collectives (no
    flags: the fourth step), rank 1 issues the rest of the forward's gathers in stand-in
    group buffers, and rank 0 raises at backward's start. Both go on in step."""
    from tests.core.helpers import spawn_ranks

    ranks = spawn_ranks(
        "tests.core.zero_worker",
        2,
        tmp_path,
        "oom_gather",
        timeout=90,
        PSTAR_TEST_DEVICE=DEV,
        PSTAR_TEST_FAIL_AT=str(at),
    )
    (step0, kind0, message0, seconds0) = ranks[0]["errors"][0]
    (step1, kind1, _message1, seconds1) = ranks[1]["errors"][0]
    assert (step0, kind0, step1, kind1) == (at, "RankFailed", at, "OutOfMemoryError")
    assert "rank 1 failed: OutOfMemoryError" in message0
    assert max(seconds0, seconds1) < 30
    assert len(ranks[0]["losses"]) == at + 1
    assert ranks[0]["losses"] == ranks[1]["losses"]
    agreed = ranks[0]["agreed"]  # before each step
    assert (agreed[at + 1] > agreed[at]) == (at == 3), agreed


def test_the_pinned_pool_is_memory_the_engine_registers_and_gives_back(fake):
    """The host tier's chunks live in one pool the engine page-locks itself (the device's
    host_register, cudaHostRegister on CUDA), exactly its own chunks' size, never through
    the caching pinned allocator (which rounds up to powers of two and keeps all)."""
    registered, through_allocator = fake.pinned_bytes(), fake.pinned_allocator_held_bytes()
    engine = make("gpt", DEV)
    pool = engine.stats()["host_pool"]
    region = HostArena.region_bytes
    own = sum(region(c.capacity, c.dtype) for c in engine.manager.own_chunks())
    params = engine.manager.own_chunks([pstar_core.chunk.ChunkType.PARAM])
    assert fake.pinned_bytes() - registered == pool["locked"]  # locked as it fills
    assert pool["live"] <= pool["locked"] <= pool["bytes"]
    assert own <= pool["bytes"] <= own + sum(region(c.capacity, torch.float32) for c in params)
    run_engine(engine, batches(2))
    assert engine.stats()["host_pool"]["fallbacks"] == 0
    assert fake.pinned_bytes() - registered == engine.stats()["host_pool"]["locked"]
    assert fake.pinned_allocator_held_bytes() == through_allocator
    engine.close()
    assert fake.pinned_bytes() == registered  # unregistered at close


def test_every_region_of_the_pinned_pool_copies_to_and_from_the_device(fake):
    """Regions of two sizes (2 and 4 bytes an element, neither a whole number of pages)
    handed out, freed and taken again: each copies to the device and back whole, which
    CUDA refuses for a region lying across two page-locked ranges (an H200 said
    cudaErrorInvalidValue at the doctor's first step, with the pool locked in 64 MiB
    slices); only what was handed out is locked, and all of it is unlocked at close."""
    numel = 5000  # 10,000 and 20,000 bytes
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32] * 8
    nbytes = sum(HostArena.region_bytes(numel, dt) for dt in dtypes)
    before = fake.pinned_bytes()
    arena = HostArena(nbytes, pin_for=torch.device(DEV))
    regions = [arena.allocate(numel, dt) for dt in dtypes]
    for r in regions[::3]:  # freed and taken again
        arena.free(r)
    regions[::3] = [arena.allocate(numel, r.dtype) for r in regions[::3]]
    assert arena.fallbacks == 0
    assert all(r is not None for r in regions)
    assert arena.locked_bytes == fake.pinned_bytes() - before <= nbytes
    for i, r in enumerate(regions):
        r.copy_(torch.full((numel,), float(i)))
        on_device = r.to(DEV, non_blocking=True).add_(1)
        r.copy_(on_device, non_blocking=True)
        torch.fakegpu.synchronize()
        assert torch.equal(r, torch.full((numel,), float(i + 1), dtype=r.dtype)), i
    arena.close()
    assert fake.pinned_bytes() == before


def test_initialize_peaks_below_16_bytes_a_parameter_with_the_host_pool_pinned(tmp_path):
    """~51M parameters in bf16 with their chunks in the pinned host pool: the peak memory
    `initialize` adds (VmHWM) is the unpinned payloads (bf16 params and fp32 masters, 6
    bytes each) plus one region of the pool, not the pool locked whole beside them (24
    bytes each: an 8B model could not start on a 128 GiB machine). The fake device's
    host_register makes its pages resident, as cudaHostRegister does."""
    from tests.core.helpers import spawn_ranks

    [r] = spawn_ranks(
        "tests.core.zero_worker",
        1,
        tmp_path,
        "init_memory",
        PSTAR_TEST_DEVICE=DEV,
        PSTAR_TEST_DTYPE="bf16",
    )
    params = r["params"]
    assert params > 50_000_000
    assert r["host_pool"]["live"] > 6 * params * 0.95  # the chunks are in the pool
    assert r["init_peak_growth"] <= 16 * params + 64 * 2**20, r["init_peak_growth"] / params


def half_the_params() -> int:
    """A device budget of N + P/2 for the test GPT on the second device, from a probe run
    (`benchmarks.doctor.budgets`: params leave the device, Adam runs on the host)."""
    from benchmarks.doctor import budgets

    probe = make("gpt", DEV)
    run_engine(probe, batches(1))
    st = probe.stats()
    probe.close()
    return budgets(st, DEV)["params_evicted"]


def test_prefetch_to_the_device_runs_on_the_copy_stream_and_lands_before_use(fake):
    """Under a budget that evicts (and leaves no room for optimizer states: Adam on the
    host), chunks the next operators use are copied host->device on a side stream while
    the current one computes; in the optimizer phase the next chunks' gradients go out
    to the host on the other copy stream while Adam runs on one, and each chunk Adam
    updated goes back. Only the device waits for a copy in. The fake device holds such a
    copy until it is waited for (a read before that sees the old bytes), so results equal
    to the CPU-as-device run show every use waited; and no buffer a copy still read was
    freed without `record_stream`."""
    budget = half_the_params()
    data = batches(4)
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data)
    hazards = fake.stream_hazards()
    engine = make("gpt", DEV, {"device_budget": budget})
    copier = engine.manager.residency.transfers._copier
    waits, wait = [], copier.wait
    copier.wait = lambda done, host=True: (waits.append(host), wait(done, host))
    on_dev = run_engine(engine, data)
    torch.testing.assert_close(torch.tensor(on_dev), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    # the host waits for copies out (it reads their bytes), never for a copy in: its
    # source goes back to the pool once its event says it is done
    assert 0 < waits.count(False) <= engine.stats()["prefetched"]["host->device"]
    assert waits.count(True) <= engine.stats()["prefetched"]["device->host"]
    prefetched = engine.stats()["prefetched"]
    assert prefetched.get("host->device", 0) > 0
    assert prefetched.get("device->host", 0) > 0
    assert fake.stream_hazards() == hazards
    engine.close()  # the parameters Adam updated last may still be on their way back
    assert fake.pending_copies() == 0


def test_chunks_needed_later_are_sent_ahead_to_make_room_for_a_prefetch(fake):
    """Under a budget that holds half the parameters, a chunk due on the device often
    finds no room: chunks needed after it leave ahead (farthest first), so it moves in at
    a later moment's prefetch instead of at its use. With `prefetch_evicts` on, more
    chunks arrive prefetched and fewer are fetched at their use than with it off. The
    modeled link is on, so copies finish by themselves. Losses equal the run without it
    and the CPU's; no buffer was freed under a copy."""
    budget = half_the_params()
    data = batches(4)
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data)
    hazards = fake.stream_hazards()
    fake.set_link(2.0, 2.0, 0.0)  # 64 KiB chunks: 33 us each
    try:
        ahead, at_use, losses = {}, {}, {}
        for evicts in (False, True):
            engine = make("gpt", DEV, {"device_budget": budget, "prefetch_evicts": evicts})
            losses[evicts] = run_engine(engine, data)
            s = engine.stats()
            ahead[evicts] = s["prefetched"]["host->device"]
            at_use[evicts] = s["moves"]["host->device"] - ahead[evicts]
            engine.close()
    finally:
        fake.set_link(0.0)
    assert losses[True] == losses[False]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    assert ahead[True] > ahead[False]
    assert at_use[True] < at_use[False]
    assert fake.stream_hazards() == hazards
    assert fake.pending_copies() == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_parameters_adam_updated_go_back_no_more_than_prefetch_chunks_at_a_time(fake, depth):
    """Over a slow link, with Adam on the host faster than a copy: after each chunk's
    Adam at most `prefetch_chunks` copies to the device are on the link (a deeper queue
    only made the next step's batch wait behind every chunk Adam updated); the others
    go back at the next forward's prefetch. Losses equal the CPU's."""
    from pstar_core.tiers import TierName

    budget = half_the_params()
    data = batches(3)
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data)
    fake.set_link(0.05, 0.05, 0.0)  # 64 KiB chunks: 1.3 ms each, slower than their Adam
    try:
        engine = make("gpt", DEV, {"device_budget": budget, "prefetch_chunks": depth})
        manager, in_flight = engine.manager, []
        adam_done = manager.adam_done

        def observed(index: int) -> None:
            adam_done(index)
            in_flight.append(manager.residency.transfers.copies_in_flight(TierName.HOST))

        manager.adam_done = observed
        losses = run_engine(engine, data)
        engine.close()
    finally:
        fake.set_link(0.0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    assert in_flight
    assert max(in_flight) == depth, in_flight


def test_accumulating_gradients_moves_no_more_a_micro_batch_than_a_step_of_one(fake):
    """Adam on the host for every chunk (half the parameters fit): a micro-batch's
    gradients are added up where Adam reads them, so a chunk goes down with its gradients
    and comes back with its parameters, as in a step of one micro-batch. (The sums and
    the masters used to come to the device instead, and the sums back: a step of two
    micro-batches moved 4.6x the param chunks down where a step of one moved 1x.) Losses
    equal the CPU's."""
    budget = half_the_params()
    data = batches(3)
    moved, losses = {}, {}
    for k in (1, 2, 4):
        engine = make("gpt", DEV, {"device_budget": budget})
        losses[k] = run_engine(engine, data, micro_batches=k)
        st = engine.stats()
        assert st["device_adam_chunks"] == 0
        moved[k] = st["bytes_moved_last_iteration"]
        engine.close()
    on_cpu = run_engine(make("gpt", "cpu", {"device_budget": budget}), data, micro_batches=2)
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(on_cpu), rtol=1e-5, atol=0)
    for k in (2, 4):
        for direction in ("host->device", "device->host"):
            assert moved[k][direction] <= k * moved[1][direction], (k, direction, moved)


def test_the_device_budget_is_the_memory_free_on_the_device(fake):
    """Without memory.device_budget the device tier plans with device_safety x (what
    mem_get_info reports free + what the allocator holds), read once the device is up."""
    fake.set_capacity(64 * 2**20)
    try:
        free, _ = fake.mem_get_info(0)
        free += fake.memory_reserved(0)  # what the allocator holds is the engine's to reuse
        engine = make("gpt", DEV)
        budget = engine.stats()["tiers"]["device"]["budget"]
        engine.close()
    finally:
        fake.set_capacity(16 * 2**30)
    assert budget == pytest.approx(0.9 * free, rel=0.02)


def test_a_rank_takes_the_device_of_its_local_rank_among_the_visible_ones(fake, monkeypatch):
    from pstar_core.devices import local_device_index

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_device_index(fake) == 1
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match="LOCAL_RANK is 5 but only 2 devices are visible"):
        local_device_index(fake)
    monkeypatch.setattr(fake, "device_count", lambda: 1)  # a narrowed CUDA_VISIBLE_DEVICES
    assert local_device_index(fake) == 0


def test_a_checkpoint_keeps_and_restores_the_devices_rng(tmp_path, fake):
    engine = make("gpt", DEV)
    run_engine(engine, batches(1))
    torch.fakegpu.manual_seed(1234)
    engine.save_checkpoint(tmp_path / "ck")
    expected = torch.rand(8, device=f"{DEV}:0").cpu()
    torch.fakegpu.manual_seed(99)
    engine.load_checkpoint(tmp_path / "ck")
    assert torch.equal(torch.rand(8, device=f"{DEV}:0").cpu(), expected)
    engine.close()


def test_outputs_the_caller_keeps_from_the_last_step_are_reserved_on_the_device(fake):
    """`out = engine(x)` in a loop keeps the last step's logits alive until the next
    forward returns: device memory the warm-up never saw. The engine measures what is
    live at each iteration's start beyond the trace's, and leaves room for it, so the
    device's own count stays within the budget (it did not without)."""
    data = batches(4, batch=32)  # logits of 512 KB, 8 chunks' worth
    probe = make("gpt", DEV)
    run_engine(probe, data[:1])
    st = probe.stats()
    probe.close()
    logits = data[0].numel() * 128 * 4  # batch x seq x vocab, fp32
    budget = int(st["tracer"]["peak_non_model_bytes"] + logits)
    budget += int(0.5 * st["chunks"]["param"]["bytes"])
    fake.reset_peak_memory_stats()
    before = fake.memory_allocated()
    engine = make("gpt", DEV, {"device_budget": budget})
    carried = 0
    for x in data:
        out = engine(input_ids=x, labels=x)  # the last step's `out` lives until here
        carried = max(carried, engine.stats()["tracer"]["carried_bytes"])
        engine.backward(out.loss)
        engine.step()
    assert out.logits.nbytes == logits
    peak = fake.max_memory_allocated() - before
    assert carried >= logits
    assert peak <= budget, (peak, budget)
    engine.close()


def test_the_tracer_reads_the_allocator_once_a_moment(fake):
    """Every moment reads the allocator's counters once, traced or not (the live bytes and
    the window's peaks come from one reading); CUDA's were a whole statistics dict
    flattened in Python, four times a traced moment."""
    engine = make("gpt", DEV)
    counters = engine.manager.tracer.counters
    run_engine(engine, batches(1))  # the traced warm-up
    moments = engine.stats()["tracer"]["moments"]
    traced_reads = counters.reads
    run_engine(engine, batches(1))
    assert counters.reads - traced_reads == moments
    assert traced_reads <= moments + 1  # the last window is closed at the end of the pass
    engine.close()


def test_a_device_module_with_nested_statistics_is_read_through_them(fake, monkeypatch):
    """Where the device module has `memory_stats_as_nested_dict` (CUDA), the counters come
    from it, one dict a reading, and never through the flattening calls."""
    from pstar_core.devices import AllocatorCounters

    calls = []
    now, peak = fake.memory_allocated, fake.max_memory_allocated

    def nested(device):
        calls.append(device)
        allocated = {"current": now(0), "peak": peak(0)}
        return {"allocated_bytes": {"all": allocated}, "reserved_bytes": {"all": {"peak": 7}}}

    def flattened(*_args):
        raise AssertionError("the flattening statistics calls were used")

    monkeypatch.setattr(fake, "memory_stats_as_nested_dict", nested, raising=False)
    monkeypatch.setattr(fake, "memory_allocated", flattened)
    monkeypatch.setattr(fake, "max_memory_allocated", flattened)
    x = torch.ones(1000, device=f"{DEV}:0")
    reading = AllocatorCounters(torch.device(f"{DEV}:0")).read()
    assert reading.allocated >= x.nbytes
    assert reading.peak_reserved == 7
    assert len(calls) == 1
