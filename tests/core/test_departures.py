"""Batches whose shape changes after the warm-up, and evaluation forwards between steps:
the engine notices, stays within its device budget, and computes what an unconstrained run
computes (see [Note: departures] in pstar_core/tracer.py)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import pstar_core
from pstar_core.config import MemoryConfig
from pstar_core.tiers import Tier, TierName
from pstar_core.tracer import Mode
from tests.core.helpers import VOCAB, engine_config, reference_model, tiny_hf_llama

CHUNK = 8192


def llama():
    """Rotary positions: any length up to 64 works, so batches can grow 4x after warm-up."""
    return tiny_hf_llama(hidden=64, intermediate=128, layers=4, positions=64)


def batch(seq: int, rows: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + seq)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(seq)) % VOCAB


# (training sequence length, evaluation sequence length after the step or None): the
# warm-up is the shortest; 32 and 64 are new maxima (re-traces), 48 is not
SCHEDULE = [(16, None), (32, 16), (16, 32), (64, 64), (16, None), (48, 64), (64, 16)]
RETRACES = 2  # at 32 and at 64 tokens per row
EVALS = sum(e is not None for _, e in SCHEDULE)


def run(memory: dict) -> tuple[list[float], list[float], object]:
    ref = reference_model(llama)
    engine = pstar_core.initialize(
        lambda: ref, engine_config(chunk_size=CHUNK, memory=memory, lr=3e-3)
    )
    losses, evals = [], []
    for i, (seq, eval_seq) in enumerate(SCHEDULE):
        x = batch(seq, seed=i)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if eval_seq is not None:
            engine.eval()
            with torch.no_grad():
                y = batch(eval_seq, seed=100 + i)
                evals.append(engine(input_ids=y, labels=y).loss.item())
            engine.train()
    return losses, evals, engine


def budgeted(budget: int):
    ref = reference_model(llama)
    return pstar_core.initialize(
        lambda: ref, engine_config(chunk_size=CHUNK, memory={"device_budget": budget})
    )


def steps(engine, x: torch.Tensor, n: int = 1) -> None:
    for _ in range(n):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


@pytest.fixture(scope="module")
def unconstrained():
    return run({})


@pytest.fixture(scope="module")
def budget(unconstrained):
    """The least budget a re-trace of the longest batch fits in, plus 40% of the param
    chunks. A re-trace cannot know its batch's non-model memory N before measuring it, so
    it lets chunks take `warmup_ratio` of the budget L (its operator's chunks, a few
    8192-element chunks here, are less than that): L >= N + warmup_ratio x L, i.e.
    L >= N / (1 - warmup_ratio). N is the unconstrained run's, whose trace is of the
    longest batch (64 tokens a row)."""
    st = unconstrained[2].stats()
    params = st["chunks"]["param"]["bytes"]
    share = 1 - MemoryConfig().warmup_ratio
    return int(st["tracer"]["peak_non_model_bytes"] / share + 0.4 * params)


def test_longer_batches_and_evaluations_under_a_tight_budget_equal_the_unconstrained_run(
    unconstrained, budget
):
    losses, evals, engine = run({"device_budget": budget, "audit": True})
    ref_losses, ref_evals, _ = unconstrained
    assert losses == ref_losses  # bitwise: eviction never changes a number
    assert evals == ref_evals
    st = engine.stats()
    tr = st["tracer"]
    # the trace was taken again for each new longest batch, and only then
    assert (tr["retraces"], tr["departures"]) == (RETRACES, RETRACES)
    assert tr["traced_batch"] == {"tokens": 4 * 64, "seq": 64}
    assert tr["untraced_passes"] == EVALS
    # eviction really happened, and the device (chunks + measured non-model memory at
    # every moment of every pass) stayed within its budget
    assert st["bytes_moved"].get("host->device", 0) > st["chunks"]["param"]["bytes"]
    assert 0 < tr["measured_peak_device_bytes"] <= budget
    assert 0 < tr["peak_device_bytes"] <= budget


def test_an_evaluation_forward_leaves_the_trace_and_the_next_iteration_alone(budget):
    engine = budgeted(budget)
    x = batch(32)
    steps(engine, x, 2)
    trace = engine.manager.tracer.trace
    names, non_model = list(trace.names), list(trace.non_model)
    with torch.no_grad():
        engine(input_ids=batch(16), labels=batch(16))
    steps(engine, x)
    tr = engine.stats()["tracer"]
    assert engine.manager.tracer.trace is trace
    assert (trace.names, trace.non_model) == (names, non_model)
    # the evaluation was a pass of its own, and the iteration after it followed the trace
    assert (tr["departures"], tr["retraces"], tr["untraced_passes"]) == (0, 0, 1)


def test_an_iteration_with_other_operators_departs_and_runs_off_trace(budget):
    engine = budgeted(budget)
    x = batch(16)
    steps(engine, x)
    # two micro-batches where one was traced: the moments stop matching at the second
    # forward; the rest of the iteration runs with conservative limits
    for half in x.chunk(2):
        engine.backward(engine(input_ids=half, labels=half).loss)
    engine.step()
    tr = engine.stats()["tracer"]
    assert (tr["departures"], tr["retraces"]) == (1, 0)
    assert engine.manager.tracer.trace.shape.tokens == x.numel()  # the trace is kept
    # and the next ordinary iteration follows the trace again
    steps(engine, x)
    assert engine.stats()["tracer"]["departures"] == 1


class DeviceStorage:
    """The chunk storage the device tier really holds, per pass and moment window: every
    payload `Tier.allocate` hands out on the device is followed by a weak reference to its
    storage, alive until the last tensor that views it is gone, whatever the engine's
    accounts say. Live storage only grows at an allocation, so sampling after each one
    and at each moment's start sees every window's most."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.starts: list[list[int]] = []  # per pass: the bytes held at each moment's start
        self.peaks: list[list[int]] = []  # per pass: the most held in each moment's window
        self.tracer = None
        allocate = Tier.allocate

        def counted(tier: Tier, numel: int, dtype: torch.dtype) -> torch.Tensor:
            payload = allocate(tier, numel, dtype)
            if tier.name is TierName.DEVICE:
                storage = payload.untyped_storage()
                self.live.append((StorageWeakRef(storage), storage.nbytes()))
                self._sample()
            return payload

        monkeypatch.setattr(Tier, "allocate", counted)

    def follow(self, tracer) -> None:
        """Sample at each moment's start and at each pass's end (before the tracer)."""
        self.tracer = tracer
        new_moment, end_pass = tracer.new_moment, tracer.end_pass

        def moment(*args, **kwargs) -> int:
            self._sample()  # the end of the window that closes
            if tracer.mode is not Mode.IDLE and tracer.moment < 0:
                self.starts.append([])
                self.peaks.append([])
            i = new_moment(*args, **kwargs)
            if tracer.mode is not Mode.IDLE:
                held = self.held()
                self.starts[-1].append(held)
                self.peaks[-1].append(held)
            return i

        def finished() -> bool:
            self._sample()
            return end_pass()

        tracer.new_moment, tracer.end_pass = moment, finished

    def held(self) -> int:
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        return sum(n for _, n in self.live)

    def _sample(self) -> None:
        t = self.tracer
        if t is not None and t.mode is not Mode.IDLE and t.moment >= 0:
            self.peaks[-1][-1] = max(self.peaks[-1][-1], self.held())


def test_the_device_peak_is_taken_moment_by_moment_per_iteration_and_since_start(
    budget, monkeypatch
):
    storage = DeviceStorage(monkeypatch)  # from the first payload on
    engine = budgeted(budget)
    storage.follow(engine.manager.tracer)
    steps(engine, batch(64), 3)
    st = engine.stats()
    tr, device = st["tracer"], st["tiers"]["device"]
    assert len(storage.peaks) == 3  # the warm-up (traced) and two iterations following it
    # the chunk bytes the trace holds are the storage the device really held, at each
    # moment's start and at the most of each window, byte for byte
    assert tr["chunk_bytes"] == storage.starts[0]
    assert tr["chunk_peak_bytes"] == storage.peaks[0]
    # each iteration's peak is N_i (measured in the warm-up) plus the chunk storage really
    # held in window i, at its worst moment; never a chunk peak from another moment
    non_model = tr["non_model_bytes"]
    peaks = [max(map(sum, zip(non_model, chunks, strict=True))) for chunks in storage.peaks]
    assert tr["peak_device_bytes_last_iteration"] == peaks[-1]
    assert tr["peak_device_bytes"] == max(peaks) <= budget
    assert 0 < tr["peak_device_bytes_last_iteration"] <= tr["peak_device_bytes"] <= budget
    assert tr["peak_device_bytes"] <= device["peak"] + tr["peak_non_model_bytes"]
    assert 0 < device["peak_last_iteration"] <= device["peak"]
