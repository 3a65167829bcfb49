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
from pstar_core.eviction import (
    choose_in_list_order,
    choose_lru,
    choose_opt,
    farthest_first,
    next_use,
)
from pstar_core.placement import BACKWARD_MOMENT, FORWARD_MOMENT, is_adam_moment
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
        tier_of_moment: Callable[[str], TierName] = lambda name: DEVICE,
    ) -> None:
        self.lists = lists
        self.memory = memory
        self.tracer = tracer
        self.tiers: dict[TierName, Tier] = make_tiers(memory, device, host_whole)
        self.payloads = PayloadIndex()
        self.transfers = Transfers(
            self.tiers, tracer, self.payloads, device, lists, memory.keep_host_copies
        )
        self._owned = owned  # ZeRO: chunks this rank keeps
        self._extra = extra  # chunks outside the lists that may be evicted (grad accum)
        self._last_use: dict[int, int] = {}  # LRU: the clock at each chunk's last use
        self._clock = 0  # operators started so far
        # What to call when the device is short of room and nothing can be evicted: waits
        # for collectives still in flight and frees their buffers, True if it freed
        # anything (ZeRO's reductions run async: `GatheredGroups.settle`)
        self._settle = settle
        self._by_moment: tuple[object, list[list[tuple[str, int]]]] | None = None
        # where each moment of the trace reads its chunks, for this iteration (the
        # placement may change between iterations): `_moment_tiers`
        self._tiers: tuple[object, list[TierName]] | None = None
        self._traced: tuple[object, list[tuple[Chunk, list[int]]]] | None = None
        self._tier_of_moment = tier_of_moment  # where a moment reads its chunks (by name)
        self._to_send: list[tuple[Chunk, TierName]] = []  # `send_ahead`'s, in order

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

    def make_resident(
        self,
        chunks: Sequence[Chunk],
        tier: TierName,
        reading: Callable[[Chunk], bool] = lambda c: False,
    ) -> None:
        """Bring `chunks` to `tier`, evicting others (never these) to make room. Those for
        which `reading` is False may be written there: their host copies go (see
        [Note: clean chunks] in transfers.py)."""
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
                self.transfers.arrive(c)  # a copy out to the host runs async: read after it
        for c in chunks:
            if not reading(c):
                self.transfers.drop_host_copy(c)

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
        if tier == HOST:
            self.transfers.drop_host_copies(need)  # before anything spills for room
        if tier == DEVICE and not self.tracer.following:
            # warm-up, or a pass off the trace: the operator's whole working set, and
            # gathered groups still in use, may exceed the conservative limit
            held = sum(
                c.nbytes
                for c in self.chunks()
                if c.tier == tier and (c.pins or id(c) in protect or not self._evictable(c, set()))
            )
            allowed = max(allowed, held + need)
        if tier == DEVICE and t.used_bytes + need + self.transfers.sending_bytes > allowed:
            # chunks sent ahead to the host hold their device memory until their copy is
            # done: wait for them before that room is used
            self.transfers.settle_sends()
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
        returning = c.host_copy is not None  # its host bytes are counted there already
        if tier == HOST and not returning and dst.used_bytes + c.nbytes > dst.budget_bytes:
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
        self.transfers.drop_host_copy(c)
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
        self.transfers.drop_host_copy(c)
        self.payloads.remove(c)
        self.tiers[c.tier].release(c.payload)
        c.payload = payload
        self.payloads.add(c)

    def in_memory(self, c: Chunk) -> Chunk:
        """Make sure `c` has a payload (bring it from disk to host if spilled, allocate it
        zeroed on the host if it has never been used); a copy on its way is waited for."""
        if c.tier == DISK or c.zero_pending:
            self.make_resident([c], HOST)
        self.transfers.arrive(c)
        self.transfers.drop_host_copy(c)  # its caller may write it
        return c

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        """Bring `chunks` into memory on the first one's tier (host if it is spilled), so
        an operation can read them together."""
        tier = chunks[0].tier
        self.make_resident(chunks, HOST if tier == DISK else tier)

    # -- prefetch (see [Note: prefetch] in prefetch.py) -----------------------------------

    def prefetch(self) -> None:
        """The current operator's chunks are in place: start moving those the next
        moments use toward where they are read (only while the trace is followed; see
        [Note: prefetch] in prefetch.py): every chunk the next `memory.prefetch_moments`
        moments use, and further ahead until `memory.prefetch_chunks` chunks are on their
        way. A chunk goes to the device only into room that stays free until its use; with
        none, chunks needed later than it are sent to the host ahead (OPT's choice), so
        the room is there a moment later."""
        depth = self.memory.prefetch_moments
        trace = self.tracer.trace
        if not depth or trace is None or not self.tracer.following:
            return
        if not self.transfers.prefetch_possible:
            return
        self.transfers.reap_sends()
        self._send_queued()
        now = self.tracer.moment
        wanted = self._wanted(now)
        movable = self._movable(now)
        for c, tier, m in wanted:
            room = self._allowed_through(now, m) if tier == DEVICE else 0
            self.transfers.ahead(c, tier, room, movable)
        first = next((w for w in wanted if w[1] == DEVICE and w[0].tier == HOST), None)
        if first is not None and self.memory.prefetch_evicts:
            self._send_ahead_for(first[0], now, first[2], movable)
        if not trace.names[now].startswith(FORWARD_MOMENT):  # forward is done with none
            self._send_done_for_host_adam(now, movable)

    def bound_for_host_adam(self, c: Chunk) -> bool:
        """Whether the trace followed says the next use of `c` is Adam on the host:
        backward is done with it."""
        if self.tracer.trace is None or not self.tracer.following:
            return False
        return self._next_is_host_adam(
            self.tracer.uses_of((c.kind.value, c.index)), self.tracer.moment
        )

    def _next_is_host_adam(self, uses: Sequence[int], now: int) -> bool:
        """Whether the first of `uses` (a chunk's traced moments) after `now` is an Adam
        moment on the host (not again in this iteration: no)."""
        trace = self.tracer.trace
        nu = next_use(uses, now, trace.moments)
        if nu >= trace.moments:
            return False
        m = int(nu)
        return is_adam_moment(trace.names[m]) and self._moment_tiers()[m] == HOST

    def send_done_after_backward(self) -> None:
        """Backward is over: what its last operators held and Adam on the host reads
        next leaves now (at an operator the chunks it uses stay)."""
        if self.tracer.trace is None or not self.tracer.following:
            return
        if self.transfers.prefetch_possible:
            self._send_done_for_host_adam(self.tracer.moment, lambda c: self._evictable(c, set()))

    def _send_done_for_host_adam(self, now: int, movable: Callable[[Chunk], bool]) -> None:
        """Device chunks whose next use is Adam on the host leave now: backward is done
        with them, and their gradients cross while it goes on."""
        arriving = self.transfers.arriving
        if HOST not in self._moment_tiers():  # Adam runs on the device for every chunk
            return
        for c, uses in self._traced_chunks():
            if c.tier != DEVICE or id(c) in arriving or not self._owned(c):
                continue
            if self._next_is_host_adam(uses, now) and movable(c):
                self.transfers.send(c)

    def _wanted(self, now: int) -> list[tuple[Chunk, TierName, int]]:
        """(chunk, the tier it is read on, its moment) for the chunks the moments after
        `now` use that are not there yet, in order of use: all of the next
        `prefetch_moments`, then on until `prefetch_chunks` were found (a moment's chunks
        all or none).

        Chunk by chunk, from its next use (a bisection in its traced uses), not moment by
        moment: with nothing to fetch a scan of the moments went to the end of the
        iteration at every operator, about 0.5 ms of Python an operator on a 114-moment
        GPT, which the unbudgeted engine on an H200 paid at every layer."""
        trace = self.tracer.trace
        depth, enough = self.memory.prefetch_moments, self.memory.prefetch_chunks
        tiers, moments = self._moment_tiers(), trace.moments
        found: list[tuple[int, Chunk, TierName]] = []
        for c, uses in self._traced_chunks():
            nu = next_use(uses, now, moments)
            if nu >= moments or c.tier == tiers[int(nu)]:  # not again, or already there
                continue
            m = int(nu)
            # an operator's optimizer-state uses (a master beside an accumulation) are
            # left to their moment; Adam's chunks all go where Adam runs
            read_there = c.kind in PARAM_LISTS or is_adam_moment(trace.names[m])
            if read_there and self._owned(c):
                found.append((m, c, tiers[m]))
        if not found:
            return []
        by_moment = self._uses_by_moment()
        found.sort(key=lambda f: (f[0], by_moment[f[0]].index((f[1].kind.value, f[1].index))))
        wanted: list[tuple[Chunk, TierName, int]] = []
        for m, c, tier in found:
            if m > now + depth and len(wanted) >= enough and (not wanted or m != wanted[-1][2]):
                break
            wanted.append((c, tier, m))
        return wanted

    def _allowed_through(self, now: int, m: int) -> int:
        """Chunk bytes the device may hold from moment `now` to `m` (the least A_j among
        them): room a prefetch takes must stay free until its chunk is used."""
        trace = self.tracer.trace
        budget = self.tiers[DEVICE].budget_bytes
        if self.memory.policy == "static":
            return int(self.memory.static_model_share * budget)
        carry = self.tracer.carry_bytes
        need = max(trace.non_model_around(k) for k in range(now, min(m, trace.moments - 1) + 1))
        return budget - need - carry

    def _movable(self, now: int) -> Callable[[Chunk], bool]:
        """Whether a chunk may be sent away ahead: evictable, and not used at moment
        `now` (Adam's chunks are not pinned while it runs on them)."""
        used_now = set(self._uses_by_moment()[now]) if now >= 0 else set()

        def movable(c: Chunk) -> bool:
            return (c.kind.value, c.index) not in used_now and self._evictable(c, set())

        return movable

    def _send_ahead_for(self, c: Chunk, now: int, m: int, movable: Callable[[Chunk], bool]) -> None:
        """`c`, needed on the device at moment `m`, found no room: send to the host the
        device chunks whose next use is later than `m` (farthest first, as OPT) until it
        would fit once their copies are done."""
        room = self._allowed_through(now, m)
        device = self.tiers[DEVICE]
        short = device.used_bytes + self.transfers.sending_bytes + c.nbytes - room
        if short <= 0:
            return  # it fits once the sends under way are done
        period = self.tracer.trace.moments
        later = [
            (nu, v)
            for v in self.chunks()
            if v.tier == DEVICE
            and id(v) not in self.transfers.arriving
            and self._owned(v)
            and movable(v)
            and (nu := next_use(self.tracer.uses_of((v.kind.value, v.index)), now, period)) > m
        ]
        if sum(v.nbytes for _, v in later) < short:
            return  # not enough to send: the move at its use makes the room
        for _, v in farthest_first(later, lambda p: p[0], lambda p: p[1].index):
            if short <= 0:
                break
            if not self.transfers.send(v):
                return  # no host room: the move at its use makes it
            short -= v.nbytes

    def send_ahead(self, c: Chunk, tier: TierName) -> None:
        """Move `c` to `tier` ahead of its use, if there is room without evicting (a chunk
        Adam just updated on the host goes back to the device while Adam runs on the
        next). Only while the trace is followed, as every prefetch.

        The copies queue in order, and no more than `memory.prefetch_chunks` of them are
        on the link at once: the rest start as those land (`_send_queued`, at each moment
        of the step), and what is left at the end of the step is the next forward's own
        prefetch. A link carries a direction's copies one after another, so a deeper
        queue would only delay what is copied behind it: the next step's batch waited
        for every chunk Adam had updated on the host when Adam was faster than the link
        (measured on fakegpu: 78 ms before each forward of 70 ms)."""
        if self.tracer.following and self.transfers.prefetch_possible and self._owned(c):
            self._to_send.append((c, tier))
            self._send_queued()

    def _send_queued(self) -> None:
        if not self._to_send:
            return
        movable = self._movable(self.tracer.moment)
        limit = self.memory.prefetch_chunks
        while self._to_send:
            c, tier = self._to_send[0]
            if self.transfers.copies_in_flight(c.tier) >= limit:
                return
            self._to_send.pop(0)
            self.transfers.ahead(c, tier, self.allowed(DEVICE), movable)

    def _traced_chunks(self) -> list[tuple[Chunk, list[int]]]:
        """Each chunk the trace uses, with the moments it uses it at (worked out once a
        trace: a chunk's key is an enum's value and a tuple, too slow to build per
        operator)."""
        trace = self.tracer.trace
        if self._traced is None or self._traced[0] is not trace:
            pairs = [(c, trace.uses.get((c.kind.value, c.index))) for c in self.chunks()]
            self._traced = (trace, [(c, uses) for c, uses in pairs if uses])
        return self._traced[1]

    def _moment_tiers(self) -> list[TierName]:
        """The tier each moment of the trace reads its chunks on (`_tier_of_moment`),
        worked out once an iteration."""
        trace = self.tracer.trace
        if self._tiers is None or self._tiers[0] is not trace:
            self._tiers = (trace, [self._tier_of_moment(name) for name in trace.names])
        return self._tiers[1]

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

    def upcoming(self, kinds: Iterable[ChunkType], moments: int) -> Iterator[Chunk]:
        """The chunks of `kinds` the next `moments` moments of the trace use, in order of
        use (those of one moment by list and index: the same order on every rank, whose
        traces noted a moment's chunks in different orders), within the pass under way
        (forward or backward); none off the trace."""
        trace = self.tracer.trace
        if trace is None or not self.tracer.following:
            return
        now = self.tracer.moment
        if now < 0:
            return
        this_pass = next(
            (p for p in (FORWARD_MOMENT, BACKWARD_MOMENT) if trace.names[now].startswith(p)),
            None,
        )
        if this_pass is None:  # an Adam moment
            return
        wanted = {k.value for k in kinds}
        by_moment = self._uses_by_moment()
        for m in range(now + 1, min(now + 1 + moments, trace.moments)):
            if not trace.names[m].startswith(this_pass):
                return
            for key in sorted(by_moment[m]):
                c = self._chunk_of_key(key) if key[0] in wanted else None
                if c is not None:
                    yield c

    def _chunk_of_key(self, key: tuple[str, int]) -> Chunk | None:
        chunks = self.lists.get(ChunkType(key[0]))
        return chunks[key[1]] if chunks is not None and key[1] < len(chunks) else None

    # -- iterations, reports, close -------------------------------------------------------

    def end_iteration(self) -> None:
        """Close the per-iteration counters (called at the end of `step()`); the sends
        ahead not started yet are left to the next forward's prefetch."""
        self._to_send.clear()
        self._tiers = None  # the placement may change before the next iteration
        self.transfers.end_iteration()
        for t in self.tiers.values():
            t.new_iteration()

    def device_chunk_bytes(self) -> int:
        """Chunk memory the device holds now: its chunks, and those on their way to the
        host (each holds its device memory until its copy is done)."""
        return self.tiers[DEVICE].used_bytes + self.transfers.sending_bytes

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
