"""`Residency`: which tier holds each chunk, and the room-making of Algorithm 1.

The memory layer is four parts:
- `tiers`: the tiers (`TierName`: device, host, disk) and their budgets;
- `transfers`: the copies between tiers (one hop each), arrivals of prefetched chunks,
  the copy stream, the disk reader and the move counters;
- here: bringing chunks to a tier (`make_resident`), making room for them (`reserve`)
  by evicting others, and letting chunks go (`forget`);
- `startup`: where a rank's chunks start, within the budgets, before training.

Algorithm 1's memory half reads top to bottom in this file: `make_resident` -> `allowed`
(how much chunk memory the tier may hold now) -> `reserve` (evict until the chunks fit)
-> `victim` (which chunk goes) -> `move` (host room made by spilling, hops through the
host). How much chunk memory the device may hold:
- at moment j of an iteration that follows the trace, A_j = L - max(N_j, N_{j+1});
- off the trace (a departed iteration, an evaluation forward), L - peak N x batch scale;
- in warm-up (or a re-trace) `warmup_ratio * L`, and under the 'static' policy always
  `static_model_share * L`; off the trace and in warm-up the operator's working set may
  exceed that share.
Victims are chosen by OPT (farthest next use, from the trace), LRU, or chunk-list order in
warm-up. When the host tier is over budget, chunks spill to disk by the same policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from pstar_core.chunk import HOLD_LIKE, PARAM_LISTS, Chunk, ChunkType
from pstar_core.config import MemoryConfig
from pstar_core.devices import check
from pstar_core.eviction import choose_in_list_order, choose_lru, choose_opt
from pstar_core.tiers import DEVICE, DISK, HOST, MemoryBudgetError, Tier, TierName, gib, make_tiers
from pstar_core.tracer import MemoryTracer
from pstar_core.transfers import PayloadIndex, Transfers

__all__ = ["Residency"]


class Residency:
    def __init__(
        self,
        lists: dict[ChunkType, list[Chunk]],
        memory: MemoryConfig,
        device: torch.device,
        tracer: MemoryTracer,
        owned: Callable[[Chunk], bool],
        extra: Callable[[], Iterable[Chunk]],
        settle: Callable[[], bool] = lambda: False,
        host_whole: int | None = None,
    ) -> None:
        self.lists = lists
        self.memory = memory
        self.tracer = tracer
        self.tiers: dict[TierName, Tier] = make_tiers(memory, device, host_whole)
        self.payloads = PayloadIndex()
        self.transfers = Transfers(self.tiers, tracer, self.payloads, device)
        self._owned = owned  # ZeRO: chunks this rank keeps
        self._extra = extra  # chunks outside the lists that may be evicted (grad accum)
        self._last_use: dict[int, int] = {}  # LRU: the clock at each chunk's last use
        self._clock = 0  # operators started so far
        # What to call when the device is short of room and nothing can be evicted: waits
        # for collectives still in flight and frees their buffers, True if it freed
        # anything (ZeRO's reductions run async: `GatheredGroups.settle`)
        self._settle = settle
        self._by_moment: tuple[object, list[list[tuple[str, int]]]] | None = None

    def chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterator[Chunk]:
        for kind, chunks in self.lists.items():
            if kinds is None or kind in kinds:
                yield from chunks

    def owned(self, c: Chunk) -> bool:
        """ZeRO: whether this rank keeps `c` (always, on one rank)."""
        return self._owned(c)

    def tick(self) -> None:
        """An operator starts (the LRU clock)."""
        self._clock += 1

    # -- Algorithm 1: bring chunks to a tier, making room by eviction ---------------------

    def make_resident(self, chunks: Sequence[Chunk], tier: TierName) -> None:
        """Bring `chunks` to `tier`, evicting others (never these) to make room."""
        for c in chunks:
            self.transfers.arrive(c)
            self.tracer.note_use((c.kind.value, c.index))
            self._last_use[id(c)] = self._clock
        need = sum(c.nbytes for c in chunks if c.tier != tier)
        if need or tier == DEVICE:
            # On the device the limit changes per moment (A_j shrinks when activations
            # grow), so it is enforced at every operator start, not only on a fetch.
            self.reserve(tier, need, protect={id(c) for c in chunks})
            for c in chunks:
                self.move(c, tier)

    def allowed(self, tier: TierName) -> int:
        """Chunk bytes `tier` may hold now: its budget; on the device, A_j."""
        t = self.tiers[tier]
        if tier != DEVICE:
            return t.budget_bytes
        if self.memory.policy == "static":
            return int(self.memory.static_model_share * t.budget_bytes)
        if self.tracer.trace is None or self.tracer.tracing:
            return int(self.memory.warmup_ratio * t.budget_bytes)
        return t.budget_bytes - self.tracer.non_model_allowance()

    def reserve(self, tier: TierName, need: int, protect: set[int]) -> None:
        """Make room for `need` more chunk bytes on `tier` by evicting chunks (never those
        whose ids are in `protect`) one tier down, until they fit `allowed(tier)`."""
        t = self.tiers[tier]
        allowed = self.allowed(tier)
        if tier == DEVICE and not self.tracer.following:
            # warm-up, or a pass off the trace: the operator's whole working set, and
            # gathered groups still in use, may exceed the conservative limit
            held = sum(
                c.nbytes
                for c in self.chunks()
                if c.tier == tier and (c.pins or id(c) in protect or not self._evictable(c, set()))
            )
            allowed = max(allowed, held + need)
        while t.used_bytes + need > allowed:
            candidates = [
                c for c in self.chunks() if c.tier == tier and self._evictable(c, protect)
            ]
            candidates += [c for c in self._extra() if c.tier == tier and id(c) not in protect]
            if not candidates:
                if tier == DEVICE and self._settle():
                    continue  # a reduction in flight held memory; it is done now
                raise MemoryBudgetError(
                    f"cannot fit {gib(need)} more chunk memory on the {tier} tier at moment "
                    f"{self.tracer.moment}: {gib(t.used_bytes)} in use by chunks that are "
                    f"needed now, {gib(allowed)} allowed (budget {gib(t.budget_bytes)}); "
                    f"raise memory.{tier}_budget"
                )
            victim = self.victim(candidates)
            self.move(victim, HOST if tier == DEVICE else DISK, protect)

    def _evictable(self, c: Chunk, protect: set[int]) -> bool:
        if id(c) in protect or c.pins:
            return False
        # COMPUTE tensors pin their param chunk; optimizer-state chunks are protected
        # explicitly while Adam runs on them.
        return c.kind not in PARAM_LISTS or all(s.state in HOLD_LIKE for s in c.slots)

    def victim(self, candidates: list[Chunk]) -> Chunk:
        """The chunk to evict: OPT while the trace is followed, else LRU (list order in
        warm-up, when no use has a history yet)."""
        trace = self.tracer.trace
        if self.memory.policy in ("lru", "static"):
            return choose_lru(candidates, self._last_use)
        if trace is None or self.tracer.tracing:
            return choose_in_list_order(candidates)
        if not self.tracer.following:  # the traced future does not hold for this pass
            return choose_lru(candidates, self._last_use)
        return choose_opt(
            candidates,
            lambda c: self.tracer.uses_of((c.kind.value, c.index)),
            self.tracer.moment,
            trace.moments,
        )

    def move(self, c: Chunk, tier: TierName, protect: set[int] | None = None) -> None:
        """Move `c` to `tier`: through the host between disk and device (the spill file
        reads and writes host memory only), spilling to disk for room on the host."""
        self.transfers.arrive(c)
        if c.tier == tier:
            return
        if {c.tier, tier} == {DISK, DEVICE}:
            self.move(c, HOST, protect)
        dst = self.tiers[tier]
        if tier == HOST and dst.used_bytes + c.nbytes > dst.budget_bytes:
            self.reserve(HOST, c.nbytes, (protect or set()) | {id(c)})
        if tier == DISK and dst.used_bytes + c.nbytes > dst.budget_bytes:
            raise MemoryBudgetError(
                f"the disk tier is full ({gib(dst.used_bytes)} of {gib(dst.budget_bytes)}); "
                "raise memory.disk_budget"
            )
        if c.tier is None:  # a zero_pending chunk's first use: not a move
            self._materialize_zeros(c, tier)
            return
        self.transfers.hop(c, tier)

    def forget(self, c: Chunk) -> None:
        """Drop a chunk's payload from whatever tier holds it (memory or disk)."""
        self.transfers.arrive(c)
        if c.tier == DISK:
            self.tiers[DISK].spill_file().free(c.disk_offset, c.nbytes)
            c.disk_offset = None
        elif c.payload is not None:
            self.payloads.remove(c)
            self.tiers[c.tier].release(c.payload)
            with self.tracer.chunk_memory():
                c.payload = None
        if c.tier is not None:
            self.tiers[c.tier].remove(c.nbytes)
        c.tier = None

    # -- payloads made outside a move ------------------------------------------------------

    def _materialize_zeros(self, c: Chunk, tier: TierName) -> None:
        assert c.zero_pending, f"{c.kind.value} chunk {c.index} has no memory and no contents"
        with self.tracer.chunk_memory():
            zeros = self.tiers[HOST if tier == DISK else tier].allocate(c.capacity, c.dtype)
            zeros.zero_()
        c.zero_pending = False
        if tier == DISK:
            c.disk_offset = self.tiers[DISK].spill_file().write(zeros)
            c.tier = DISK
            self.tiers[DISK].add(c.nbytes)
        else:
            self.adopt(c, zeros, tier)

    def adopt(self, c: Chunk, payload: torch.Tensor, tier: TierName) -> None:
        """Register a payload made outside a move (a gathered remote chunk, an accum chunk)."""
        c.payload = payload
        c.tier = tier
        self.tiers[tier].add(c.nbytes)
        self.payloads.add(c)

    def rehome(self, c: Chunk, payload: torch.Tensor) -> None:
        """Swap the payload of a chunk for another on the same tier holding the same bytes
        (a chunk entering or leaving a gathered group's buffer); its old one is dropped."""
        check(
            payload.device == c.payload.device,
            f"{c.kind.value} chunk {c.index} rehomed from {c.payload.device} to {payload.device}",
        )
        self.payloads.remove(c)
        self.tiers[c.tier].release(c.payload)
        c.payload = payload
        self.payloads.add(c)

    def in_memory(self, c: Chunk) -> Chunk:
        """Make sure `c` has a payload (bring it from disk to host if spilled, allocate it
        zeroed on the host if it has never been used)."""
        if c.tier == DISK or c.zero_pending:
            self.make_resident([c], HOST)
        return c

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        """Bring `chunks` into memory on the first one's tier (host if it is spilled), so
        an operation can read them together."""
        tier = chunks[0].tier
        self.make_resident(chunks, HOST if tier == DISK else tier)

    # -- prefetch (see [Note: prefetch] in prefetch.py) -----------------------------------

    def prefetch(self) -> None:
        """The current operator's chunks are in place: start moving those the next
        `memory.prefetch_moments` moments use (only while the trace is followed)."""
        depth = self.memory.prefetch_moments
        trace = self.tracer.trace
        if not depth or trace is None or not self.tracer.following:
            return
        if not self.transfers.prefetch_possible:
            return
        by_moment = self._uses_by_moment()
        now = self.tracer.moment
        upcoming = (
            c
            for m in range(now + 1, min(now + depth, trace.moments - 1) + 1)
            for key in by_moment[m]
            if (c := self._chunk_of_key(key)) is not None
        )
        self.transfers.prefetch(upcoming, self._owned, self.allowed(DEVICE))

    def _uses_by_moment(self) -> list[list[tuple[str, int]]]:
        trace = self.tracer.trace
        if self._by_moment is None or self._by_moment[0] is not trace:
            by_moment: list[list[tuple[str, int]]] = [[] for _ in range(trace.moments)]
            for key, moments in trace.uses.items():
                for m in moments:
                    if m < trace.moments:
                        by_moment[m].append(key)
            self._by_moment = (trace, by_moment)
        return self._by_moment[1]

    def _chunk_of_key(self, key: tuple[str, int]) -> Chunk | None:
        chunks = self.lists.get(ChunkType(key[0]))
        return chunks[key[1]] if chunks is not None and key[1] < len(chunks) else None

    # -- iterations, reports, close -------------------------------------------------------

    def end_iteration(self) -> None:
        """Close the per-iteration counters (called at the end of `step()`)."""
        self.transfers.end_iteration()
        for t in self.tiers.values():
            t.new_iteration()

    def host_pool(self) -> dict[str, int] | None:
        """The pinned pool's size, bytes page-locked so far, bytes in use, and chunks that
        found no room in it."""
        arena = self.tiers[HOST].arena
        if arena is None:
            return None
        return {
            "bytes": arena.nbytes,
            "locked": arena.locked_bytes,
            "live": arena.live_bytes,
            "fallbacks": arena.fallbacks,
        }

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        return {
            str(name): {
                "budget": t.budget_bytes,
                "used": t.used_bytes,
                "peak": t.peak_bytes,
                "peak_last_iteration": t.last_iteration_peak_bytes,
            }
            for name, t in self.tiers.items()
        }

    def close(self) -> None:
        for c in list(self.chunks()):
            self.transfers.arrive(c)
        self.transfers.close()
        for t in self.tiers.values():
            t.close()
