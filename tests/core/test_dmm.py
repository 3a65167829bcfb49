"""Dynamic memory management: budgets change where chunks live, never the math."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from pstar_core.chunk import ChunkType
from pstar_core.tiers import MemoryBudgetError
from tests.core.helpers import MODELS, batches, engine_config, reference_model, run_engine

CHUNK = 16384  # small chunks so the tiny GPT has a dozen param chunks to move around


@pytest.fixture(scope="module")
def ref():
    return reference_model(MODELS["gpt"])


def make(ref, memory=None, name="gpt", **kw):
    engine = pstar_core.initialize(
        MODELS[name], engine_config(chunk_size=CHUNK, memory=memory or {}, **kw)
    )
    engine.load_state_dict(ref.state_dict())
    return engine


@pytest.fixture(scope="module")
def unconstrained(ref):
    """Losses and trace without memory pressure: the ground truth for every policy."""
    engine = make(ref)
    losses = run_engine(engine, batches(4))
    stats = engine.stats()
    return losses, stats["tracer"]["peak_non_model_bytes"], stats["chunks"]["param"]["bytes"]


@pytest.mark.parametrize("policy", ["opt", "lru", "static"])
def test_device_budget_of_40_percent_of_param_chunks_gives_bitwise_same_losses(
    ref, unconstrained, policy
):
    losses, peak_non_model, param_bytes = unconstrained
    # 40% of the param chunks for model data, beside the measured activations; the static
    # partition has no tracer, so it gets the same bytes as a fixed share of the device.
    budget = int(peak_non_model + 0.4 * param_bytes)
    memory = {"device_budget": budget, "policy": policy}
    if policy == "static":
        memory["static_model_share"] = 0.4 * param_bytes / budget
    engine = make(ref, memory)
    assert run_engine(engine, batches(4)) == losses
    moved = engine.stats()["bytes_moved"]
    assert moved["device->host"] > 0  # the budget really forced evictions
    assert engine.manager.residency.tiers["device"].peak_bytes <= budget


def test_a_chunk_evicted_before_anything_wrote_it_copies_nothing_back(ref, unconstrained):
    """[Note: clean chunks] Under 40% of the param chunks, forward evicts parameters it
    only read: with their host copies kept, those evictions copy nothing (fewer bytes
    device->host than without the copies, the same host->device), and the losses are the
    same bitwise. A chunk written on the device (gradients in backward) is copied back."""
    losses, peak_non_model, param_bytes = unconstrained
    budget = int(peak_non_model + 0.4 * param_bytes)
    moved, clean = {}, {}
    for keep in (False, True):
        engine = make(ref, {"device_budget": budget, "keep_host_copies": keep})
        assert run_engine(engine, batches(4)) == losses
        st = engine.stats()
        moved[keep], clean[keep] = st["bytes_moved"], st["clean_evictions"]
        # every byte kept on the host for a copy is within the host's account
        tiers = engine.manager.residency.tiers
        assert tiers["host"].used_bytes <= tiers["host"].budget_bytes
    assert clean[False] == 0 < clean[True]
    assert 0 < moved[True]["device->host"] < moved[False]["device->host"]
    assert moved[True]["host->device"] == moved[False]["host->device"]


def test_disk_tier_keeps_training_when_model_data_exceeds_device_plus_host(
    ref, unconstrained, tmp_path
):
    losses, peak_non_model, param_bytes = unconstrained
    engine0 = make(ref)
    chunk_bytes = engine0.stats()["chunk_bytes"]
    device = int(peak_non_model + 0.4 * param_bytes)
    host = chunk_bytes // 3
    assert device + host < chunk_bytes  # model data exceeds device + host budgets
    memory = {
        "device_budget": device, "host_budget": host, "disk_budget": 10 * chunk_bytes,
        "disk_dir": str(tmp_path),
    }  # fmt: skip
    engine = make(ref, memory)
    assert run_engine(engine, batches(4)) == losses
    moved = engine.stats()["bytes_moved"]
    assert moved["host->disk"] > 0
    assert moved["disk->host"] + moved.get("disk->device", 0) > 0
    assert engine.manager.residency.tiers["host"].peak_bytes <= host


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_from_disk_overlaps_and_changes_nothing(ref, unconstrained, tmp_path, depth):
    # chunks spilled to disk are read back by a background thread ahead of their use
    losses, peak_non_model, param_bytes = unconstrained
    chunk_bytes = make(ref).stats()["chunk_bytes"]
    memory = {
        "device_budget": int(peak_non_model + 0.4 * param_bytes), "host_budget": chunk_bytes // 3,
        "disk_budget": 10 * chunk_bytes, "disk_dir": str(tmp_path), "prefetch_moments": depth,
    }  # fmt: skip
    engine = make(ref, memory)
    assert run_engine(engine, batches(4)) == losses
    stats = engine.stats()
    prefetched = stats["prefetched"].get("disk->host", 0)
    if depth:
        assert prefetched > 0
        # prefetched moves are moves: counted once, in the same counters
        assert stats["bytes_moved"]["disk->host"] >= prefetched * min(
            c.nbytes for c in engine.manager.chunks()
        )
    else:
        assert prefetched == 0
    host = engine.manager.residency.tiers["host"]
    assert host.peak_bytes <= host.budget_bytes  # a prefetch never breaks the budget
    assert not engine.manager.residency.transfers.arriving or engine.manager.tracer.following
    engine.close()


@pytest.mark.parametrize("spill", [False, True], ids=["host", "host+disk"])
def test_host_chunks_sliced_from_one_pool_sized_to_this_rank(
    ref, unconstrained, tmp_path, monkeypatch, spill
):
    # the GPU layout (one pinned buffer sliced into the rank's chunks), unpinned here
    losses, peak_non_model, param_bytes = unconstrained
    monkeypatch.setenv("PSTAR_HOST_ARENA", "1")
    chunk_bytes = make(ref).stats()["chunk_bytes"]
    memory = {"device_budget": int(peak_non_model + 0.4 * param_bytes)}
    if spill:
        memory |= {"host_budget": chunk_bytes // 3, "disk_budget": 10 * chunk_bytes}
        memory |= {"disk_dir": str(tmp_path)}
    engine = make(ref, memory)
    pool = engine.stats()["host_pool"]
    host = engine.manager.residency.tiers["host"]
    params = engine.manager.lists[ChunkType.PARAM]
    accumulation = sum(4 * c.capacity for c in params)  # an fp32 chunk per trainable one
    assert pool["bytes"] == min(chunk_bytes + accumulation, host.budget_bytes)
    assert run_engine(engine, batches(4)) == losses
    pool = engine.stats()["host_pool"]
    # every chunk on the host is a slice of the pool, and nothing else is
    on_host = [c for c in engine.manager.chunks() if c.tier == "host"]
    assert on_host
    assert all(host.arena.owns(c.payload) for c in on_host)
    assert pool["live"] == sum(c.nbytes for c in on_host) == host.used_bytes
    assert pool["fallbacks"] == 0
    if spill:
        assert engine.stats()["bytes_moved"]["host->disk"] > 0


def test_moments_repeat_and_steady_state_moves_nothing_with_enough_memory(ref):
    engine = make(ref)
    data = batches(5)
    run_engine(engine, data[:2])  # warm-up, then the iteration that applies placement
    trace = engine.manager.tracer.trace
    moved_before = dict(engine.stats()["bytes_moved"])
    run_engine(engine, data[2:4])
    assert engine.stats()["bytes_moved"] == moved_before  # nothing moved at all
    assert engine.stats()["bytes_moved_last_iteration"] == {}
    # the moment sequence of a later iteration is the traced one
    tracer = engine.manager.tracer
    tracer.trace = None  # trace one more iteration and compare
    run_engine(engine, data[4:])
    again = tracer.trace
    assert again.moments == trace.moments
    assert again.names == trace.names
    assert again.uses == trace.uses


def test_placement_puts_optimizer_states_on_the_device_when_the_margin_allows(ref, unconstrained):
    losses, peak_non_model, param_bytes = unconstrained
    engine = make(ref)
    run_engine(engine, batches(2))
    assert engine.manager.device_adam == set(range(engine.plan.trainable.num_chunks))
    chunks = engine.stats()["chunks"]
    assert chunks["momentum"]["by_tier"] == {"device": chunks["momentum"]["count"]}
    # a margin for only part of the optimizer states: some Adam on device, the rest on
    # host, and the same numbers either way
    triple = 3 * CHUNK * 4
    budget = int(peak_non_model + param_bytes + 2.5 * triple)
    partial = make(ref, {"device_budget": budget})
    assert run_engine(partial, batches(4)) == losses
    assert 0 < len(partial.manager.device_adam) < partial.plan.trainable.num_chunks


def test_traced_non_model_peak_grows_with_batch_and_shrinks_with_checkpointing(ref):
    def peak(batch, ckpt=False):
        engine = make(ref, activation_checkpointing=ckpt)
        run_engine(engine, batches(1, batch=batch))
        return engine.stats()["tracer"]["peak_non_model_bytes"]

    small, large = peak(4), peak(16)
    assert large > 2 * small
    assert peak(16, ckpt=True) < large


def test_tracer_counts_a_temporary_allocated_and_freed_inside_forward():
    class Scratch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            tmp = torch.empty(4 * 2**20, dtype=torch.uint8)  # 4 MiB, gone before returning
            tmp.fill_(1)
            del tmp
            return self.lin(x).sum()

    engine = pstar_core.initialize(Scratch, engine_config(chunk_size=1024))
    engine.backward(engine(torch.randn(2, 8)))
    engine.step()
    assert engine.stats()["tracer"]["peak_non_model_bytes"] >= 4 * 2**20


def test_model_larger_than_all_budgets_fails_before_training_with_numbers(ref):
    with pytest.raises(MemoryBudgetError, match=r"needs [\d.]+ MiB of chunks.*budgets give"):
        make(ref, {"device_budget": 100_000, "host_budget": 100_000})


def test_operator_larger_than_the_device_fails_before_training(ref):
    with pytest.raises(MemoryBudgetError, match=r"needs .* of param chunks at once"):
        make(ref, {"device_budget": CHUNK})


def test_stats_report_tiers_moves_and_the_trace(ref):
    engine = make(ref)
    run_engine(engine, batches(1))
    stats = engine.stats()
    assert stats["tracer"]["moments"] == len(engine.manager.tracer.trace.names)
    assert stats["tracer"]["moments"] > 0
    assert set(stats["tiers"]) == {"device", "host", "disk"}
    assert stats["bytes_moved"]["host->device"] > 0
    # the warm-up iteration moved chunks, and said so per iteration too
    assert stats["bytes_moved_last_iteration"] == stats["bytes_moved"]
    assert stats["moves_last_iteration"]["host->device"] > 0


def test_storage_map_never_points_at_freed_chunks_after_accumulation(ref):
    # A freed chunk's address can be reused by any activation; a stale entry would make
    # the saved-tensor hook treat that activation as a chunk view.
    engine = make(ref)
    for x in batches(3):
        for mb in x.chunk(2):
            engine.backward(engine(input_ids=mb, labels=mb).loss)
        engine.step()
        for ptr, chunks in engine.manager.residency.payloads.items():
            assert chunks
            for chunk in chunks:
                assert chunk.payload is not None, chunk.kind
                assert chunk.payload.untyped_storage().data_ptr() == ptr


def test_host_too_small_for_the_warmup_step_fails_at_initialize_not_mid_run(ref):
    # The device could hold the rest, but the warm-up step updates every chunk on the
    # host; refusing up front is what keeps the run from failing in its first step.
    chunk_bytes = make(ref).stats()["chunk_bytes"]
    memory = {"device_budget": 10 * chunk_bytes, "host_budget": int(0.7 * chunk_bytes)}
    with pytest.raises(MemoryBudgetError, match="warm-up step updates every chunk on the host"):
        make(ref, memory)


def test_trace_records_the_chunk_bytes_each_operator_computes_with(ref):
    # C_i at a moment's start misses the chunks its operator then brings (on CUDA, where
    # N_i = R_i - C_i, they would count as non-model memory); the trace keeps, per window,
    # the least chunk bytes held once the operator's chunks were in place
    engine = make(ref, {"device_budget": 6 * CHUNK * 2 * 14})
    run_engine(engine, batches(1))
    t = engine.stats()["tracer"]
    start, compute, peak = t["chunk_bytes"], t["chunk_compute_bytes"], t["chunk_peak_bytes"]
    assert len(compute) == len(start) == len(peak) == t["moments"]
    assert all(c <= p for c, p in zip(compute, peak, strict=True))
    brought = [i for i in range(len(start)) if compute[i] > start[i]]
    assert brought, "no operator brought chunks to the device in the warm-up"
    # the first operator starts with an empty device and computes with its chunk there
    assert engine.manager.tracer.trace.names[0].startswith("fwd:")
    assert start[0] == 0
    assert compute[0] >= CHUNK * 2  # a bf16 param chunk


def test_a_slot_view_follows_its_chunk_and_never_keeps_an_evicted_buffer(ref):
    """Parameters point at views of their chunk made once per payload: after an eviction
    (a new payload), Access points them at the new buffer, and the old one is freed."""
    import gc
    import weakref

    engine = pstar_core.initialize(lambda: ref, engine_config(chunk_size=16384))
    run_engine(engine, batches(2))
    m = engine.manager
    moved = [c for c in m.chunks([ChunkType.PARAM]) if c.payload is not None and c.slots]
    chunk = moved[0]
    slot = chunk.slots[0]
    old = weakref.ref(chunk.payload.untyped_storage())
    assert chunk.view(slot).untyped_storage().data_ptr() == chunk.payload.data_ptr()
    target = "host" if chunk.tier == "device" else "device"
    m.residency.move(chunk, target)
    gc.collect()
    assert old() is None  # no cached view held the evicted buffer
    view = chunk.view(slot)
    assert view.untyped_storage().data_ptr() == chunk.payload.untyped_storage().data_ptr()
    torch.testing.assert_close(view, chunk.payload[slot.offset : slot.end].view(slot.shape))
    engine.close()
