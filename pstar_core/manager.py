"""`ChunkManager`: owns the chunk lists, their tiers, and the paper's Access and Release.

Access makes an operator's param chunks resident on the compute device (evicting others
when the device budget is reached), points `param.data` at the slots and sets COMPUTE;
Release sets the HOLD-like state and points `param.data` at an empty placeholder, so a
parameter has real storage only while an operator needs it.

How much chunk memory the device may hold at moment j is A_j = L - max(N_j, N_{j+1})
once the warm-up trace exists (policy 'opt' or 'lru'); during warm-up it is
`warmup_ratio * L`, and under the 'static' policy always `static_model_share * L`.
Victims are chosen by OPT (farthest next use), LRU, or chunk-list order in warm-up.
When the host tier is over budget, chunks spill to disk by the same policy.

[Note: gradient accumulation] After backward a trainable slot holds its gradient
(HOLD_AFTER_BWD), which is how the paper avoids a grad list. When the next micro-batch
accesses such a chunk before `step()`, the manager adds the chunk's gradients into an
fp32 GRAD_ACCUM chunk (allocated then, freed by `step()`) and re-derives the parameter
values from the fp32 master: the param chunk was produced by casting the master, so the
re-derived values are bitwise the ones the slot held. Cost: 4 bytes per trainable
parameter of the accessed chunks, only between the first re-access and the step;
`stats()["grad_accum_bytes"]` reports it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from pstar_core.chunk import HOLD_LIKE, Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.config import MemoryConfig
from pstar_core.eviction import choose_in_list_order, choose_lru, choose_opt
from pstar_core.mapping import Plan
from pstar_core.tiers import MemoryBudgetError, Tier, gib, make_tiers
from pstar_core.tracer import MemoryTracer
from pstar_core.zero import ZeroGroup

log = logging.getLogger(__name__)

S = TensorState
TRAINABLE_LISTS = (ChunkType.PARAM, ChunkType.PARAM_FP32, ChunkType.MOMENTUM, ChunkType.VARIANCE)
PARAM_LISTS = (ChunkType.PARAM, ChunkType.FROZEN)


class ChunkManager:
    def __init__(
        self,
        plan: Plan,
        dtype: torch.dtype,
        device: torch.device,
        memory: MemoryConfig,
        zero: ZeroGroup | None = None,
    ) -> None:
        self.plan = plan
        self.zero = zero or ZeroGroup.single()
        self.dtype = dtype
        self.device = device
        self.memory = memory
        self.tiers: dict[str, Tier] = make_tiers(memory, device)
        self.tracer = MemoryTracer(device, audit=memory.audit)
        size = plan.chunk_size
        # Lists are padded to whole communication groups (nproc chunks each).
        n = self.zero.nproc
        n_tr = -(-plan.trainable.num_chunks // n) * n
        n_fr = -(-plan.frozen.num_chunks // n) * n
        dtypes = {ChunkType.PARAM: dtype, ChunkType.FROZEN: dtype}
        self.lists: dict[ChunkType, list[Chunk]] = {
            kind: [Chunk(kind, i, size, dtypes.get(kind, torch.float32)) for i in range(n)]
            for kind, n in [(k, n_tr) for k in TRAINABLE_LISTS] + [(ChunkType.FROZEN, n_fr)]
        }
        # ZeRO: the rank owning each chunk, balanced per group (`mapping.balanced_owners`);
        # the trainable lists share one assignment, as they share one layout
        tr_owners, fr_owners = plan.trainable.owners(n), plan.frozen.owners(n)
        self._owners = {kind: tr_owners for kind in (*TRAINABLE_LISTS, ChunkType.GRAD_ACCUM)}
        self._owners[ChunkType.FROZEN] = fr_owners
        self.grad_accum: dict[int, Chunk] = {}
        self.slots: list[TensorSlot] = []
        # Released parameters point here: zero elements, so a stray use fails loudly
        # instead of reading stale memory, while dtype and device stay truthful.
        self._placeholder = torch.empty(0, dtype=dtype, device=device)
        self.bytes_moved: dict[str, int] = {}  # in total
        self.moves: dict[str, int] = {}
        self.iteration_bytes_moved: dict[str, int] = {}  # in the iteration under way
        self.iteration_moves: dict[str, int] = {}
        self.last_iteration_bytes_moved: dict[str, int] = {}  # in the last complete one
        self.last_iteration_moves: dict[str, int] = {}
        self.peak_grad_accum_bytes = 0
        self.device_adam: set[int] = set()  # trainable chunks whose Adam runs on the device
        self.margin_bytes = 0  # device bytes left for optimizer states by the last trace
        self._last_use: dict[int, int] = {}
        self._clock = 0
        self._by_storage: dict[int, Chunk] = {}
        self._live_groups: dict[tuple[ChunkType, int], list[Chunk]] = {}

    # -- layout -------------------------------------------------------------------------

    def param_chunk(self, slot: TensorSlot) -> Chunk:
        kind = ChunkType.PARAM if slot.trainable else ChunkType.FROZEN
        return self.lists[kind][slot.chunk_index]

    def chunk_of(self, kind: ChunkType, slot: TensorSlot) -> Chunk:
        return self.lists[kind][slot.chunk_index]

    def add_slot(self, slot: TensorSlot) -> None:
        self.slots.append(slot)
        self.param_chunk(slot).slots.append(slot)
        if slot.trainable:
            for kind in TRAINABLE_LISTS[1:]:
                self.lists[kind][slot.chunk_index].slots.append(slot)

    def chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        for kind, chunks in self.lists.items():
            if kinds is None or kind in kinds:
                yield from chunks

    def owner(self, c: Chunk) -> int:
        """The rank that owns `c` (keeps it, updates it, sends it to the others)."""
        return self._owners[c.kind][c.index]

    def owned(self, c: Chunk) -> bool:
        return self.owner(c) == self.zero.rank

    def own_chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        return (c for c in self.chunks(kinds) if self.owned(c))

    def allocate_all(self) -> None:
        """Every chunk starts in host memory, zeroed (FREE tensors read as 0).

        Budgets are enforced right after the weights are materialized
        (`enforce_budgets`), which may spill chunks to disk. With ZeRO, other ranks'
        chunks exist here only until then (`drop_remote`).
        """
        self._check_total_fits()
        host = self.tiers["host"]
        for c in self.chunks():
            with self.tracer.chunk_memory():
                c.payload = host.allocate(c.capacity, c.dtype).zero_()
            c.tier = "host"
            host.add(c.nbytes)
            self._by_storage[c.payload.untyped_storage().data_ptr()] = c

    def drop_remote(self) -> None:
        """Free the chunks other ranks own (all lists): this rank keeps 1/nproc."""
        for c in self.chunks():
            if not self.owned(c) and c.payload is not None:
                self._forget(c)

    def _forget(self, c: Chunk) -> None:
        self._by_storage.pop(c.payload.untyped_storage().data_ptr(), None)
        self.tiers[c.tier].remove(c.nbytes)
        with self.tracer.chunk_memory():
            c.payload = None
        c.tier = None

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
        need = sum(c.nbytes for c in self.own_chunks())
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

    def check_working_sets(self, operators: Sequence[Sequence[TensorSlot]]) -> None:
        """Fail before training if one operator's chunks cannot fit on the device at all."""
        budget = self.tiers["device"].budget_bytes
        if self.memory.policy == "static":
            budget = int(self.memory.static_model_share * budget)
        for slots in operators:
            chunks = {id(c): c for c in (self.param_chunk(s) for s in slots)}
            need = sum(c.nbytes for c in chunks.values()) * self.zero.nproc
            if need > budget:
                raise MemoryBudgetError(
                    f"operator using {slots[0].name} needs {gib(need)} of param chunks at once, "
                    f"the device budget for chunks is {gib(budget)}; raise "
                    "memory.device_budget or use a smaller chunk_size"
                )

    def enforce_budgets(self) -> None:
        """After materialization: what the host budget cannot hold goes to the device (up
        to the share model data may use in warm-up), then to disk."""
        host, device = self.tiers["host"], self.tiers["device"]
        share = self._device_share()
        for c in self.chunks(PARAM_LISTS):
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
            if c.tier is not None
        ]
        for c in reversed(order):  # the last chunks of the optimizer lists are needed last
            if host.used_bytes <= host.budget_bytes:
                break
            self._move(c, "disk")
        # Known limit: materialization holds every chunk in host memory before this
        # spill, so peaks are counted from here on (from the start of training).
        for t in self.tiers.values():
            t.peak_bytes = t.iteration_peak_bytes = t.used_bytes

    # -- Access / Release (Algorithms 1 and 2) ------------------------------------------

    def begin_operator(self, name: str) -> None:
        """A new moment: an operator is about to start."""
        device = self.tiers["device"]
        self.tracer.new_moment(name, device.used_bytes, device.new_window())
        self._clock += 1

    def end_pass(self) -> bool:
        """The iteration (or evaluation forward) is over: close the tracer's pass; True if
        it recorded a new trace (placement is then decided again from it)."""
        self.tracer.close_window(self.tiers["device"].new_window())
        traced = self.tracer.end_pass()
        if traced:
            self.margin_bytes = self.place_optimizer_states()
        return traced

    def access_slots(self, slots: Sequence[TensorSlot], forward: bool = False) -> None:
        """Algorithm 1 for every tensor one operator needs."""
        chunks = list({id(c): c for c in (self.param_chunk(s) for s in slots)}.values())
        if self.zero.enabled:
            for c in chunks:
                self._gather_group(c)  # a no-op while its group is gathered
        self.make_resident(chunks, "device")
        for s in slots:
            self._access(s, self.param_chunk(s))
            s.forward_uses += forward

    def _access(self, slot: TensorSlot, chunk: Chunk) -> None:
        if slot.state is S.HOLD_AFTER_BWD:
            self._stash_grads(chunk)  # (with ZeRO, already done before the gather)
        if slot.state is S.FREE:
            chunk.flat(slot).zero_()
        slot.set_state(S.COMPUTE)
        slot.compute_refs += 1
        if slot.compute_refs == 1:
            slot.param.data = chunk.view(slot)

    def release(self, slot: TensorSlot, target: TensorState) -> None:
        """Algorithm 2: the operator is done with `slot` (the last of its users sets
        `target` and drops the storage). Only a COMPUTE tensor can be released."""
        if slot.state is not S.COMPUTE:
            raise RuntimeError(
                f"release of {slot.name} in state {slot.state.name}: only a tensor in COMPUTE "
                f"can be released (to {target.name})"
            )
        slot.compute_refs -= 1
        if slot.compute_refs > 0:
            return
        slot.set_state(target)
        slot.param.data = self._placeholder
        if self.zero.enabled and target is S.HOLD_AFTER_FWD:
            self._maybe_release_group(self.param_chunk(slot), done={S.HOLD_AFTER_FWD})

    @staticmethod
    def _forward_done(s: TensorSlot) -> bool:
        # A tied weight is registered by several modules and used by each in forward:
        # its group stays gathered until the last of them has run.
        return s.state is S.HOLD_AFTER_FWD and s.forward_uses >= len(s.aliases)

    def release_all(self, target: TensorState) -> None:
        """Force every COMPUTE tensor to `target` (end of forward/backward clean-up)."""
        for slot in self.slots:
            if slot.state is S.COMPUTE:
                slot.compute_refs = 1
                self.release(slot, target)

    def grad_ready(self, slot: TensorSlot, grad: torch.Tensor) -> None:
        """Backward is done with `slot`: its gradient overwrites the param slot."""
        chunk = self.param_chunk(slot)
        if slot.state is not S.COMPUTE:
            # A gradient for a tensor not accessed in backward (used outside its module's
            # forward): bring its chunk back first; the slot still holds the value.
            self.make_resident([chunk], "device")
            slot.set_state(S.COMPUTE)
        chunk.view(slot).copy_(grad)
        slot.compute_refs = 0
        slot.set_state(S.HOLD_AFTER_BWD)
        slot.param.data = self._placeholder
        if self.zero.enabled:
            self._maybe_release_group(chunk, done={S.HOLD_AFTER_BWD})

    def reset_after_forward(self) -> None:
        for slot in self.slots:
            slot.forward_uses = 0
            if slot.state is S.HOLD_AFTER_FWD:
                slot.set_state(S.HOLD)

    # -- residency and moves ----------------------------------------------------------------

    def make_resident(self, chunks: Sequence[Chunk], tier: str) -> None:
        """Bring `chunks` to `tier`, evicting others (never these) to make room."""
        for c in chunks:
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
                for c in self.chunks()
                if c.tier == tier and (c.pins or id(c) in protect or not self._evictable(c, set()))
            )
            allowed = max(allowed, held + need)
        while t.used_bytes + need > allowed:
            candidates = [
                c for c in self.chunks() if c.tier == tier and self._evictable(c, protect)
            ]
            candidates += [
                c for c in self.grad_accum.values() if c.tier == tier and id(c) not in protect
            ]
            if not candidates:
                raise MemoryBudgetError(
                    f"cannot fit {gib(need)} more chunk memory on the {tier} tier at moment "
                    f"{self.tracer.moment}: {gib(t.used_bytes)} in use by chunks that are "
                    f"needed now, {gib(allowed)} allowed (budget {gib(t.budget_bytes)}); "
                    f"raise memory.{tier}_budget"
                )
            victim = self._choose(candidates)
            self._move(victim, "host" if tier == "device" else "disk", protect)

    def _move(self, c: Chunk, tier: str, protect: set[int] | None = None) -> None:
        src = c.tier
        if src == tier:
            return
        dst = self.tiers[tier]
        if tier == "host" and dst.used_bytes + c.nbytes > dst.budget_bytes:
            self._make_room("host", c.nbytes, (protect or set()) | {id(c)})
        if tier == "disk" and dst.used_bytes + c.nbytes > dst.budget_bytes:
            raise MemoryBudgetError(
                f"the disk tier is full ({gib(dst.used_bytes)} of {gib(dst.budget_bytes)}); "
                "raise memory.disk_budget"
            )
        with self.tracer.chunk_memory():
            if tier == "disk":
                c.disk_offset = dst.spill_file().write(c.payload)
                self._by_storage.pop(c.payload.untyped_storage().data_ptr(), None)
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
                    self._by_storage.pop(c.payload.untyped_storage().data_ptr(), None)
                c.payload = new
                self._by_storage[new.untyped_storage().data_ptr()] = c
        if src is not None:
            self.tiers[src].remove(c.nbytes)
        dst.add(c.nbytes)
        c.tier = tier
        key = f"{src}->{tier}"
        for counter, n in (
            (self.bytes_moved, c.nbytes),
            (self.moves, 1),
            (self.iteration_bytes_moved, c.nbytes),
            (self.iteration_moves, 1),
        ):
            counter[key] = counter.get(key, 0) + n

    def end_iteration(self) -> None:
        """Close the per-iteration move counters (called at the end of `step()`)."""
        self.last_iteration_bytes_moved = self.iteration_bytes_moved
        self.last_iteration_moves = self.iteration_moves
        self.iteration_bytes_moved, self.iteration_moves = {}, {}
        for t in self.tiers.values():
            t.new_iteration()

    def chunk_for_storage(self, data_ptr: int) -> Chunk | None:
        """The chunk whose current payload is this storage (a freed chunk's old address
        may be reused by any tensor, so the entry is checked against the payload)."""
        c = self._by_storage.get(data_ptr)
        if c is None or c.payload is None or c.payload.untyped_storage().data_ptr() != data_ptr:
            return None
        return c

    def in_memory(self, c: Chunk) -> Chunk:
        """Make sure `c` has a payload (bring it from disk to host if spilled)."""
        if c.tier == "disk":
            self.make_resident([c], "host")
        return c

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        """Bring `chunks` into memory on the first one's tier (host if it is spilled), so
        an operation can read them together."""
        tier = chunks[0].tier
        self.make_resident(chunks, "host" if tier == "disk" else tier)

    # -- ZeRO communication groups ----------------------------------------------------------

    def _group(self, c: Chunk) -> list[Chunk]:
        """The communication group of `c`, ordered by owner rank (as collectives order)."""
        members = [self.lists[c.kind][i] for i in self.zero.members(c.index)]
        return sorted(members, key=self.owner)

    def _gather_group(self, c: Chunk) -> None:
        """All-gather the group of `c`: remote chunks arrive on the device, in HOLD."""
        key = (c.kind, c.index // self.zero.nproc)
        if key in self._live_groups:
            return
        members = self._group(c)
        own = next(m for m in members if self.owned(m))
        for m in members:
            if any(s.state is S.HOLD_AFTER_BWD for s in m.slots):
                if self.owned(m):
                    self._stash_grads(m)
                else:  # its owner moves those grads out of the way in its own stash
                    for s in m.slots:
                        if s.state is S.HOLD_AFTER_BWD:
                            s.set_state(S.HOLD)
        remote = [m for m in members if m is not own]
        self.make_resident([own], "device")
        own.pins += 1
        need = sum(m.nbytes for m in remote)
        self._make_room("device", need, protect={id(m) for m in members})
        device = self.tiers["device"]
        with self.tracer.chunk_memory():
            for m in remote:
                m.payload = device.allocate(m.capacity, m.dtype)
                m.tier = "device"
                device.add(m.nbytes)
                m.pins += 1
                self._by_storage[m.payload.untyped_storage().data_ptr()] = m
            self.zero.gather(own.payload, [m.payload for m in members])
        self._live_groups[key] = members
        for m in remote:
            self.tracer.note_use((m.kind.value, m.index))

    def _maybe_release_group(self, c: Chunk, done: set[TensorState]) -> None:
        key = (c.kind, c.index // self.zero.nproc)
        members = self._live_groups.get(key)
        if members is None:
            return
        backward = S.HOLD_AFTER_BWD in done
        finished = (lambda s: s.state in done) if backward else self._forward_done
        if all(finished(s) for m in members for s in m.slots):
            self._release_group(key, reduce=backward)

    def _release_group(self, key: tuple[ChunkType, int], reduce: bool) -> None:
        """Reduce-scatter the group's grads (after backward), then drop remote chunks."""
        members = self._live_groups.pop(key)
        own = next(m for m in members if self.owned(m))
        if reduce and key[0] is ChunkType.PARAM:
            self._reduce_group(members, own)
        for m in members:
            m.pins -= 1
            if m is not own:
                self._forget(m)

    def _reduce_group(self, members: list[Chunk], own: Chunk) -> None:
        # Slots without a gradient hold parameter values: send zeros for them, and
        # restore the owner's values from its fp32 master afterwards.
        for m in members:
            for s in m.slots:
                if s.state is not S.HOLD_AFTER_BWD:
                    m.flat(s).zero_()
        with self.tracer.chunk_memory():
            out = self.tiers["device"].allocate(own.capacity, own.dtype)
        self.zero.reduce_scatter_mean([m.payload for m in members], out)
        own.payload.copy_(out)
        master = self.lists[ChunkType.PARAM_FP32][own.index]
        for s in own.slots:
            if s.state is not S.HOLD_AFTER_BWD:
                self.in_memory(master)
                own.flat(s).copy_(master.flat(s))

    def drop_gathered_groups(self) -> None:
        """Drop every gathered group without collectives or a reduction (an abandoned
        iteration: its gradients are dropped anyway)."""
        for members in self._live_groups.values():
            for m in members:
                m.pins -= 1
                if not self.owned(m):
                    self._forget(m)
        self._live_groups.clear()

    def finish_forward(self) -> None:
        """End of forward: drop every group still gathered (same order on every rank)."""
        for key in sorted(self._live_groups, key=lambda k: (k[0].value, k[1])):
            self._release_group(key, reduce=False)

    def finish_backward(self) -> None:
        """End of backward: reduce and drop the groups that some unused tensor kept open."""
        for key in sorted(self._live_groups, key=lambda k: (k[0].value, k[1])):
            self._release_group(key, reduce=True)

    # -- placement ------------------------------------------------------------------------

    def place_optimizer_states(self) -> int:
        """Device-aware placement after warm-up: OS chunks that fit the margin go to the device.

        margin = device budget - peak non-model - all param chunks. Returns the margin.
        """
        trace = self.tracer.trace
        self.device_adam.clear()  # a re-trace decides again
        if trace is None or self.memory.policy == "static":
            return 0
        params = sum(c.nbytes for c in self.own_chunks(PARAM_LISTS))
        if self.zero.enabled:  # two gathered groups may be in flight at once
            params += 2 * (self.zero.nproc - 1) * self.lists[ChunkType.PARAM][0].nbytes
        margin = self.tiers["device"].budget_bytes - trace.peak_non_model - params
        left = margin
        for i in range(len(self.lists[ChunkType.PARAM])):
            if not self.owned(self.lists[ChunkType.PARAM][i]):
                continue
            triple = sum(self.lists[k][i].nbytes for k in TRAINABLE_LISTS[1:])
            if triple > left:
                break
            self.device_adam.add(i)
            left -= triple
        return margin

    def prepare_adam(self, index: int) -> None:
        """Adam on chunk `index` is next: a moment, and its four chunks on one tier."""
        self.begin_operator(f"adam.{index}")
        tier = "device" if index in self.device_adam else "host"
        chunks = [self.lists[k][index] for k in TRAINABLE_LISTS]
        acc = self.grad_accum.get(index)
        if acc is not None:
            chunks.append(acc)
        self.make_resident(chunks, tier)

    # -- gradient accumulation ----------------------------------------------------------

    def _stash_grads(self, chunk: Chunk) -> None:
        """Move the chunk's gradients into its fp32 accum chunk and restore the params."""
        acc = self.grad_accum.get(chunk.index)
        master = self.lists[ChunkType.PARAM_FP32][chunk.index]
        if acc is None:
            acc = Chunk(ChunkType.GRAD_ACCUM, chunk.index, chunk.capacity, torch.float32)
            self._make_room(chunk.tier, acc.nbytes, {id(chunk), id(master)})
            with self.tracer.chunk_memory():
                acc.payload = self.tiers[chunk.tier].allocate(acc.capacity, acc.dtype).zero_()
            acc.tier = chunk.tier
            self.tiers[chunk.tier].add(acc.nbytes)
            self.grad_accum[chunk.index] = acc
            self.peak_grad_accum_bytes = max(self.peak_grad_accum_bytes, self.grad_accum_bytes)
        self.colocate([chunk, acc, master])
        for s in chunk.slots:
            if s.state is S.HOLD_AFTER_BWD:
                acc.flat(s).add_(chunk.flat(s))
                chunk.flat(s).copy_(master.flat(s))
                s.grad_in_accum = True
                s.set_state(S.HOLD)

    @property
    def grad_accum_bytes(self) -> int:
        return sum(c.nbytes for c in self.grad_accum.values())

    def free_grad_accum(self) -> None:
        for acc in self.grad_accum.values():
            if acc.disk_offset is not None:
                self.tiers["disk"].spill_file().free(acc.disk_offset, acc.nbytes)
                acc.disk_offset = None
            elif acc.payload is not None:
                self._by_storage.pop(acc.payload.untyped_storage().data_ptr(), None)
            self.tiers[acc.tier].remove(acc.nbytes)
            with self.tracer.chunk_memory():
                acc.payload = None
            acc.tier = None
        self.grad_accum.clear()
        for s in self.slots:
            s.grad_in_accum = False

    # -- accounting ----------------------------------------------------------------------

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

    def close(self) -> None:
        """Free every chunk on every tier and close the spill file."""
        self.free_grad_accum()
        self._live_groups.clear()
        for c in self.chunks():
            if c.payload is not None:
                self._forget(c)
            elif c.tier == "disk":
                self.tiers["disk"].remove(c.nbytes)
                c.tier, c.disk_offset = None, None
        for t in self.tiers.values():
            t.close()
