"""`Residency`: where each chunk's payload lives, and the budgets of the tiers.

It owns the three tiers (device, host, disk) and every move between them: a chunk is
brought to a tier with `make_resident`, which first makes room by evicting others (never
the ones asked for) with the policy's victim choice, and every move is a real copy,
counted per direction. How much chunk memory the device may hold:
- at moment j of an iteration that follows the trace, A_j = L - max(N_j, N_{j+1});
- off the trace (a departed iteration, an evaluation forward), L - peak N x batch scale;
- in warm-up (or a re-trace) `warmup_ratio * L`, and under the 'static' policy always
  `static_model_share * L`; off the trace and in warm-up the operator's working set may
  exceed that share.
Victims are chosen by OPT (farthest next use, from the trace), LRU, or chunk-list order in
warm-up. When the host tier is over budget, chunks spill to disk by the same policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch.autograd.profiler import record_function

from pstar_core.chunk import HOLD_LIKE, Chunk, ChunkType
from pstar_core.config import MemoryConfig
from pstar_core.devices import CopyStream, check
from pstar_core.eviction import choose_in_list_order, choose_lru, choose_opt
from pstar_core.prefetch import Arrival, DiskReader
from pstar_core.tiers import MemoryBudgetError, Tier, gib, make_tiers
from pstar_core.tracer import MemoryTracer

PARAM_LISTS = (ChunkType.PARAM, ChunkType.FROZEN)
ZERO_AT_START = (ChunkType.MOMENTUM, ChunkType.VARIANCE)


class Residency:
    def __init__(
        self,
        lists: dict[ChunkType, list[Chunk]],
        memory: MemoryConfig,
        device: torch.device,
        tracer: MemoryTracer,
        owned: Callable[[Chunk], bool],
        extra: Callable[[], Iterable[Chunk]],
    ) -> None:
        self.lists = lists
        self.memory = memory
        self.tracer = tracer
        self.tiers: dict[str, Tier] = make_tiers(memory, device)
        self._owned = owned  # ZeRO: chunks this rank keeps
        self._extra = extra  # chunks outside the lists that may be evicted (grad accum)
        self.bytes_moved: dict[str, int] = {}  # in total
        self.load_peak_bytes: dict[str, int] = {}  # per tier, until training starts
        self.moves: dict[str, int] = {}
        self.iteration_bytes_moved: dict[str, int] = {}  # in the iteration under way
        self.iteration_moves: dict[str, int] = {}
        self.last_iteration_bytes_moved: dict[str, int] = {}  # in the last complete one
        self.last_iteration_moves: dict[str, int] = {}
        self._last_use: dict[int, int] = {}  # LRU: the clock at each chunk's last use
        self._clock = 0  # operators started so far
        # storage address -> the chunks whose payload lies in it (one each, except a
        # gathered ZeRO group: its chunks are slices of one buffer); for saved tensors
        self._by_storage: dict[int, list[Chunk]] = {}
        # waits for collectives still in flight and frees their buffers; True if it freed
        # anything (set by ZeRO's gathered groups: their reductions run asynchronously)
        self.settle: Callable[[], bool] = lambda: False
        # [Note: prefetch] moves under way, by chunk id; the reader and the copy stream
        self._arriving: dict[int, Arrival] = {}
        self._reader = DiskReader()
        self._copier = CopyStream(device)
        self.prefetched: dict[str, int] = {}  # direction -> chunks prefetched in total
        self._by_moment: tuple[object, list[list[tuple[str, int]]]] | None = None

    def _chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        for kind, chunks in self.lists.items():
            if kinds is None or kind in kinds:
                yield from chunks

    def tick(self) -> None:
        """An operator starts (the LRU clock)."""
        self._clock += 1

    def allocate_all(self, streamed: bool = False) -> bool:
        """Every chunk of this rank the weights are written into starts in host memory,
        zeroed (FREE tensors read as 0); momentum and variance start as zeros without
        memory and are allocated at their first use (`Chunk.zero_pending`). Other ranks'
        chunks never get memory here: under ZeRO a rank materializes only its own share
        (their tensors are initialized into a staging buffer and dropped, see
        `Engine._materialize`).

        `streamed` (the weights stream from files into the slots, one tensor at a time):
        frozen chunks, too, get memory only when their first tensor arrives, and once all
        their tensors are in, they may spill to disk to make room for the next ones, so
        loading a frozen base (a LoRA model's) holds no more than the host budget. This
        needs room in the host budget for the trainable lists and one frozen chunk in
        flight; returns whether frozen chunks are lazy.

        Budgets are enforced right after the weights are materialized
        (`enforce_budgets`), which may spill chunks to disk.
        """
        self._check_total_fits()
        host = self.tiers["host"]
        frozen = self.lists[ChunkType.FROZEN]
        eager = sum(
            c.nbytes
            for c in self._chunks()
            if self._owned(c) and c.kind not in (*ZERO_AT_START, ChunkType.FROZEN)
        )
        lazy = streamed and bool(frozen) and eager + 2 * frozen[0].nbytes <= host.budget_bytes
        for c in self._chunks():
            if not self._owned(c):
                continue
            if c.kind in ZERO_AT_START or (lazy and c.kind is ChunkType.FROZEN):
                c.zero_pending = True
                continue
            with self.tracer.chunk_memory():
                payload = host.allocate(c.capacity, c.dtype).zero_()
            self.adopt(c, payload, "host")
        return lazy

    def _device_share(self) -> int:
        """Chunk bytes the device may hold before the trace exists (warm-up or static)."""
        ratio = (
            self.memory.static_model_share
            if self.memory.policy == "static"
            else (self.memory.warmup_ratio)
        )
        return int(ratio * self.tiers["device"].budget_bytes)

    def _check_total_fits(self) -> None:
        """Fail before training when the chunks cannot all pass through host and disk.

        The warm-up step runs Adam on the host for every chunk (placement is decided
        from its trace), so at its end every chunk is in host memory or on disk; the
        device budget cannot count here without risking a failure mid-run.
        """
        need = sum(c.nbytes for c in self._chunks() if self._owned(c))
        t = self.tiers
        have = t["host"].budget_bytes + t["disk"].budget_bytes
        if need > have:
            raise MemoryBudgetError(
                f"the model needs {gib(need)} of chunks (model data), the budgets give "
                f"{gib(have)} (host {gib(t['host'].budget_bytes)}, disk "
                f"{gib(t['disk'].budget_bytes)}; the warm-up step updates every chunk on the "
                "host, so the device budget does not count here); raise memory.host_budget "
                "or memory.disk_budget (with memory.disk_dir), or use a smaller model / "
                "fewer trainable parameters"
            )

    def enforce_budgets(self) -> None:
        """After materialization: what the host budget cannot hold goes to the device (up
        to the share model data may use in warm-up), then to disk."""
        host, device = self.tiers["host"], self.tiers["device"]
        share = self._device_share()
        for c in self._chunks(PARAM_LISTS):
            if host.used_bytes <= host.budget_bytes:
                break
            if c.tier == "host" and device.used_bytes + c.nbytes <= share:
                self._move(c, "device")
        order = [
            c
            for kind in (
                ChunkType.VARIANCE,
                ChunkType.MOMENTUM,
                ChunkType.PARAM_FP32,
                *PARAM_LISTS[::-1],
            )
            for c in self.lists[kind]
            if c.tier == "host"  # what the host cannot hold; chunks on the device stay there
        ]
        for c in reversed(order):  # the last chunks of the optimizer lists are needed last
            if host.used_bytes <= host.budget_bytes:
                break
            self._move(c, "disk")
        # Materialization holds all of this rank's chunks in host memory before this
        # spill (frozen chunks excepted when streamed, see `allocate_all`), so the
        # loading peaks are kept apart and training's are counted from here on.
        self.load_peak_bytes = {name: t.peak_bytes for name, t in self.tiers.items()}
        for t in self.tiers.values():
            t.peak_bytes = t.iteration_peak_bytes = t.used_bytes

    def pin_host_chunks(self) -> None:
        """After materialization (remote chunks dropped, budgets enforced): the host
        tier's chunks move into its pool, sized to what this rank can ever hold there."""
        host = self.tiers["host"]
        if not host.use_arena:
            return
        own = sum(c.nbytes for c in self._chunks() if self._owned(c))
        # gradient accumulation adds an fp32 chunk per trainable chunk while it runs
        own += sum(4 * c.capacity for c in self.lists[ChunkType.PARAM] if self._owned(c))
        host.make_arena(min(own, host.budget_bytes))
        for c in self._chunks():
            if c.tier == "host" and c.payload is not None:
                with self.tracer.chunk_memory():
                    pinned = host.allocate(c.capacity, c.dtype)
                    pinned.copy_(c.payload)
                    self.rehome(c, pinned)

    def make_resident(self, chunks: Sequence[Chunk], tier: str) -> None:
        """Bring `chunks` to `tier`, evicting others (never these) to make room."""
        for c in chunks:
            self.arrive(c)
            self.tracer.note_use((c.kind.value, c.index))
            self._last_use[id(c)] = self._clock
        need = sum(c.nbytes for c in chunks if c.tier != tier)
        if need or tier == "device":
            # On the device the limit changes per moment (A_j shrinks when activations
            # grow), so it is enforced at every operator start, not only on a fetch.
            self._make_room(tier, need, protect={id(c) for c in chunks})
            for c in chunks:
                self._move(c, tier)

    def _allowed(self, tier: str) -> int:
        t = self.tiers[tier]
        if tier != "device":
            return t.budget_bytes
        if self.memory.policy == "static":
            return int(self.memory.static_model_share * t.budget_bytes)
        if self.tracer.trace is None or self.tracer.tracing:
            return int(self.memory.warmup_ratio * t.budget_bytes)
        return t.budget_bytes - self.tracer.non_model_allowance()

    def _evictable(self, c: Chunk, protect: set[int]) -> bool:
        if id(c) in protect or c.pins:
            return False
        # COMPUTE tensors pin their param chunk; optimizer-state chunks are protected
        # explicitly while Adam runs on them.
        return c.kind not in PARAM_LISTS or all(s.state in HOLD_LIKE for s in c.slots)

    def _choose(self, candidates: list[Chunk]) -> Chunk:
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

    def _make_room(self, tier: str, need: int, protect: set[int]) -> None:
        t = self.tiers[tier]
        allowed = self._allowed(tier)
        if tier == "device" and not self.tracer.following:
            # warm-up, or a pass off the trace: the operator's whole working set, and
            # gathered groups still in use, may exceed the conservative limit
            held = sum(
                c.nbytes
                for c in self._chunks()
                if c.tier == tier and (c.pins or id(c) in protect or not self._evictable(c, set()))
            )
            allowed = max(allowed, held + need)
        while t.used_bytes + need > allowed:
            candidates = [
                c for c in self._chunks() if c.tier == tier and self._evictable(c, protect)
            ]
            candidates += [c for c in self._extra() if c.tier == tier and id(c) not in protect]
            if not candidates:
                if tier == "device" and self.settle():
                    continue  # a reduction in flight held memory; it is done now
                raise MemoryBudgetError(
                    f"cannot fit {gib(need)} more chunk memory on the {tier} tier at moment "
                    f"{self.tracer.moment}: {gib(t.used_bytes)} in use by chunks that are "
                    f"needed now, {gib(allowed)} allowed (budget {gib(t.budget_bytes)}); "
                    f"raise memory.{tier}_budget"
                )
            victim = self._choose(candidates)
            self._move(victim, "host" if tier == "device" else "disk", protect)

    def _move(self, c: Chunk, tier: str, protect: set[int] | None = None) -> None:
        self.arrive(c)
        src = c.tier
        if src == tier:
            return
        if {src, tier} == {"disk", "device"}:
            # moves go disk <-> host <-> device: the spill file reads and writes host
            # memory only (a GPU buffer cannot be read as NumPy or filled from a file)
            self._move(c, "host", protect)
            src = c.tier
        dst = self.tiers[tier]
        if tier == "host" and dst.used_bytes + c.nbytes > dst.budget_bytes:
            self._make_room("host", c.nbytes, (protect or set()) | {id(c)})
        if tier == "disk" and dst.used_bytes + c.nbytes > dst.budget_bytes:
            raise MemoryBudgetError(
                f"the disk tier is full ({gib(dst.used_bytes)} of {gib(dst.budget_bytes)}); "
                "raise memory.disk_budget"
            )
        if src is None:  # a zero_pending chunk's first use: not a move
            self._materialize_zeros(c, tier)
            return
        with self.tracer.chunk_memory(), record_function(f"pstar::move {src}->{tier}"):
            if tier == "disk":
                c.disk_offset = dst.spill_file().write(c.payload)
                self._unregister(c)
                self.tiers[src].release(c.payload)
                c.payload = None
            else:
                new = dst.allocate(c.capacity, c.dtype)
                if src == "disk":
                    spill = self.tiers["disk"].spill_file()
                    spill.read(c.disk_offset, new)
                    spill.free(c.disk_offset, c.nbytes)
                    c.disk_offset = None
                else:
                    new.copy_(c.payload)
                    self._unregister(c)
                    self.tiers[src].release(c.payload)
                c.payload = new
                self._register(c)
        self._account(c, src, tier)

    def end_iteration(self) -> None:
        """Close the per-iteration move counters (called at the end of `step()`)."""
        self.last_iteration_bytes_moved = self.iteration_bytes_moved
        self.last_iteration_moves = self.iteration_moves
        self.iteration_bytes_moved, self.iteration_moves = {}, {}
        for t in self.tiers.values():
            t.new_iteration()

    def _register(self, c: Chunk) -> None:
        self._by_storage.setdefault(c.payload.untyped_storage().data_ptr(), []).append(c)

    def _unregister(self, c: Chunk) -> None:
        ptr = c.payload.untyped_storage().data_ptr()
        chunks = self._by_storage.get(ptr, [])
        if c in chunks:
            chunks.remove(c)
        if not chunks:
            self._by_storage.pop(ptr, None)

    def chunk_of_tensor(self, t: torch.Tensor) -> Chunk | None:
        """The chunk whose current payload holds `t` (a view of it), or None. A freed
        chunk's old address may be reused by any tensor, so entries are checked against
        the payloads they name."""
        ptr, start = t.untyped_storage().data_ptr(), t.storage_offset()
        for c in self._by_storage.get(ptr, ()):
            p = c.payload
            if (
                p is not None
                and p.dtype == t.dtype
                and p.untyped_storage().data_ptr() == ptr
                and p.storage_offset() <= start < p.storage_offset() + c.capacity
            ):
                return c
        return None

    def in_memory(self, c: Chunk) -> Chunk:
        """Make sure `c` has a payload (bring it from disk to host if spilled, allocate it
        zeroed on the host if it has never been used)."""
        if c.tier == "disk" or c.zero_pending:
            self.make_resident([c], "host")
        return c

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        """Bring `chunks` into memory on the first one's tier (host if it is spilled), so
        an operation can read them together."""
        tier = chunks[0].tier
        self.make_resident(chunks, "host" if tier == "disk" else tier)

    def host_pool(self) -> dict[str, int] | None:
        """The pinned pool's size, bytes in use, and chunks that found no room in it."""
        arena = self.tiers["host"].arena
        if arena is None:
            return None
        return {"bytes": arena.nbytes, "live": arena.live_bytes, "fallbacks": arena.fallbacks}

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        return {
            name: {
                "budget": t.budget_bytes,
                "used": t.used_bytes,
                "peak": t.peak_bytes,
                "peak_last_iteration": t.last_iteration_peak_bytes,
            }
            for name, t in self.tiers.items()
        }

    def _materialize_zeros(self, c: Chunk, tier: str) -> None:
        assert c.zero_pending, f"{c.kind.value} chunk {c.index} has no memory and no contents"
        with self.tracer.chunk_memory():
            zeros = self.tiers["host" if tier == "disk" else tier].allocate(c.capacity, c.dtype)
            zeros.zero_()
        c.zero_pending = False
        if tier == "disk":
            c.disk_offset = self.tiers["disk"].spill_file().write(zeros)
            c.tier = "disk"
            self.tiers["disk"].add(c.nbytes)
        else:
            self.adopt(c, zeros, tier)

    def forget(self, c: Chunk) -> None:
        """Drop a chunk's payload from whatever tier holds it (memory or disk)."""
        self.arrive(c)
        if c.tier == "disk":
            self.tiers["disk"].spill_file().free(c.disk_offset, c.nbytes)
            c.disk_offset = None
        elif c.payload is not None:
            self._unregister(c)
            self.tiers[c.tier].release(c.payload)
            with self.tracer.chunk_memory():
                c.payload = None
        if c.tier is not None:
            self.tiers[c.tier].remove(c.nbytes)
        c.tier = None

    def adopt(self, c: Chunk, payload: torch.Tensor, tier: str) -> None:
        """Register a payload made outside a move (a gathered remote chunk, an accum chunk)."""
        c.payload = payload
        c.tier = tier
        self.tiers[tier].add(c.nbytes)
        self._register(c)

    def rehome(self, c: Chunk, payload: torch.Tensor) -> None:
        """Swap the payload of a chunk for another on the same tier holding the same bytes
        (a chunk entering or leaving a gathered group's buffer); its old one is dropped."""
        check(
            payload.device == c.payload.device,
            f"{c.kind.value} chunk {c.index} rehomed from {c.payload.device} to {payload.device}",
        )
        self._unregister(c)
        self.tiers[c.tier].release(c.payload)
        c.payload = payload
        self._register(c)

    def close(self) -> None:
        for c in list(self._chunks()):
            self.arrive(c)
        self._reader.close()
        for t in self.tiers.values():
            t.close()

    # -- prefetch (see [Note: prefetch] in prefetch.py) -----------------------------------

    def arrive(self, c: Chunk) -> None:
        """Wait until a prefetched chunk's payload holds its bytes (no-op otherwise)."""
        a = self._arriving.pop(id(c), None)
        if a is None:
            return
        with record_function("pstar::wait prefetch"):
            if a.src == "disk":
                a.done.result()
                self.tiers["disk"].spill_file().free(a.disk_offset, c.nbytes)
            else:
                self._copier.wait(a.done)
                self.tiers["host"].release(a.source)

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

    def prefetch(self) -> None:
        """The current operator's chunks are in place: start moving those the next
        `memory.prefetch_moments` moments use (only while the trace is followed)."""
        depth = self.memory.prefetch_moments
        trace = self.tracer.trace
        if not depth or trace is None or not self.tracer.following:
            return
        spill = self.tiers["disk"].spill
        if spill is None and not self._copier.enabled:
            return  # nothing is ever far away: no disk tier, no copy stream
        by_moment = self._uses_by_moment()
        now = self.tracer.moment
        for m in range(now + 1, min(now + depth, trace.moments - 1) + 1):
            for key in by_moment[m]:
                c = self._chunk_of_key(key)
                if c is None or id(c) in self._arriving or c.pins or not self._owned(c):
                    continue
                if c.tier == "disk" and spill is not None:
                    self._prefetch_from_disk(c)
                elif c.tier == "host" and self._copier.enabled and c.kind in PARAM_LISTS:
                    self._prefetch_to_device(c)

    def _prefetch_from_disk(self, c: Chunk) -> None:
        host = self.tiers["host"]
        if host.used_bytes + c.nbytes > host.budget_bytes:
            # no eviction for a prefetch: measured, evicting chunks needed later to make
            # room moved 17% more bytes per step and made it slower, not faster
            return
        disk = self.tiers["disk"]
        with self.tracer.chunk_memory():
            new = host.allocate(c.capacity, c.dtype)
        done = self._reader.submit(disk.spill_file(), c.disk_offset, new)
        self._arriving[id(c)] = Arrival("disk", done, c.disk_offset, None)
        c.disk_offset = None
        c.payload = new
        self._register(c)
        self._account(c, "disk", "host")
        self.prefetched["disk->host"] = self.prefetched.get("disk->host", 0) + 1

    def _prefetch_to_device(self, c: Chunk) -> None:
        device = self.tiers["device"]
        if device.used_bytes + c.nbytes > self._allowed("device"):
            return  # never evicts for a prefetch on the device: A_j is tight there
        with self.tracer.chunk_memory():
            new = device.allocate(c.capacity, c.dtype)
        source = c.payload
        done = self._copier.copy(new, source)
        self._unregister(c)
        self._arriving[id(c)] = Arrival("host", done, None, source)
        c.payload = new
        self._register(c)
        self._account(c, "host", "device")
        self.prefetched["host->device"] = self.prefetched.get("host->device", 0) + 1

    def _account(self, c: Chunk, src: str, dst: str) -> None:
        """A move of `c` from tier `src` to `dst`: the tiers' bytes and the move counters."""
        self.tiers[src].remove(c.nbytes)
        self.tiers[dst].add(c.nbytes)
        c.tier = dst
        key = f"{src}->{dst}"
        for counter, n in (
            (self.bytes_moved, c.nbytes),
            (self.moves, 1),
            (self.iteration_bytes_moved, c.nbytes),
            (self.iteration_moves, 1),
        ):
            counter[key] = counter.get(key, 0) + n
