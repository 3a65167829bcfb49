"""`ChunkManager`: the chunk lists, their tensors, and the paper's Access and Release.

Access (Algorithm 1) makes an operator's param chunks resident on the compute device
(gathering their ZeRO group first), points `param.data` at the slots and sets COMPUTE;
Release (Algorithm 2) sets the HOLD-like state and points `param.data` at an empty
placeholder, so a parameter has real storage only while an operator needs it.

The rest lives beside it, one concern a module:
- `residency.Residency`: Algorithm 1's memory half, where `access_slots` continues: bring
  chunks to a tier, the limit A_j, making room by eviction (OPT), letting chunks go;
- `transfers.Transfers`: the copies between tiers, prefetch arrivals, move counters;
- `tiers`: the tiers (`TierName`) and their budgets; `startup`: where chunks start;
- `groups.GatheredGroups`: the ZeRO communication groups' gather / reduce / release;
- `accum.GradAccumulator`: gradients kept across micro-batches;
- `placement`: which optimizer-state chunks live (and are updated) on the device;
- `tracer.MemoryTracer`: moments, non-model memory, departures from the trace.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pstar_core import placement
from pstar_core.accum import GradAccumulator
from pstar_core.chunk import (
    PARAM_LISTS,
    TRAINABLE_LISTS,
    Chunk,
    ChunkType,
    TensorSlot,
    TensorState,
)
from pstar_core.config import MemoryConfig
from pstar_core.groups import GatheredGroups
from pstar_core.mapping import Plan
from pstar_core.residency import Residency
from pstar_core.tiers import MemoryBudgetError, TierName, gib
from pstar_core.tracer import MemoryTracer, profiled
from pstar_core.zero import ZeroGroup

# how far ahead the next ZeRO group is looked for (its gather starts at most that early)
GATHER_AHEAD_MOMENTS = 4

log = logging.getLogger(__name__)

__all__ = ["ChunkManager", "TrainingPhase"]


# a trainable tensor in these states holds its value, and forward only reads it
_READ_IN_FORWARD = frozenset({TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.COMPUTE})


class TrainingPhase(enum.Enum):
    """Where the engine is in an iteration (one enum, as FSDP2's `TrainingState`)."""

    IDLE = "idle"  # between iterations
    FORWARD = "forward"  # a training forward
    BACKWARD = "backward"  # inside `backward()` (recomputed forwards included)
    STEP = "step"  # the optimizer
    EVALUATION = "evaluation"  # a forward outside an iteration (no_grad or eval())


class ChunkManager:
    def __init__(
        self,
        plan: Plan,
        dtype: torch.dtype,
        device: torch.device,
        memory: MemoryConfig,
        zero: ZeroGroup | None = None,
        host_whole: int | None = None,
    ) -> None:
        self.plan = plan
        self.zero = zero or ZeroGroup.single()
        self.dtype = dtype
        self.device = device
        self.memory = memory
        self.phase = TrainingPhase.IDLE
        self.tracer = MemoryTracer(device, audit=memory.audit)
        size = plan.chunk_size
        # Lists are padded to whole communication groups (nproc chunks each).
        n = self.zero.nproc
        n_tr, n_fr = (k * n for k in plan.rank_chunks(n))
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
        self.slots: list[TensorSlot] = []
        # Released parameters point here: zero elements, so a stray use fails loudly
        # instead of reading stale memory, while dtype and device stay truthful.
        self._placeholder = torch.empty(0, dtype=dtype, device=device)
        self.residency = Residency(
            self.lists,
            memory,
            device,
            self.tracer,
            self.owned,
            extra=lambda: self.grad_accum.values(),
            # ZeRO's reductions in flight hold device memory until waited on; settled
            # because the device is full (see [Note: leaving the group buffer] in groups.py)
            settle=lambda: self.groups.settle(pressed=True),
            host_whole=host_whole,  # the host share read at the engine's start
            tier_of_moment=lambda name: placement.moment_tier(self.device_adam, name),
        )
        self.grad_accum = GradAccumulator(
            self.residency,
            self.lists,
            adam_tier=lambda c: (
                placement.adam_tier(self.device_adam, c.index) if self.owned(c) else c.tier
            ),
        )
        self.groups = GatheredGroups(
            self.zero,
            self.lists,
            self.owner,
            self.residency,
            self.grad_accum.stash,
            self._forward_done,
        )
        self.device_adam: set[int] = set()  # trainable chunks whose Adam runs on the device
        # the placement of the run a checkpoint continues, kept after the first trace while
        # it fits ([Note: a resumed run places as the run it continues] in placement.py)
        self._continued_adam: set[int] | None = None
        self.margin_bytes = 0  # device bytes left for optimizer states by the last trace
        # Observers of Access, each called with an operator's slots once `access_slots`
        # has put them in place (`pstar doctor` samples the allocator there). Empty, they
        # cost Access one test of this list.
        self.on_access: list[Callable[[Sequence[TensorSlot]], None]] = []
        # called as each backward operator starts (Adam beside backward: see beside.py)
        self.backward_operator: Callable[[], None] | None = None

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

    def drop_remote(self) -> None:
        """Free the chunks other ranks own (all lists): this rank keeps 1/nproc."""
        for c in self.chunks():
            if self.owned(c):
                continue
            if c.payload is not None or c.tier == TierName.DISK:  # disk: spilled while loading
                self.residency.forget(c)
            c.zero_pending = False  # gathered from its owner, never made here

    def drop_storage(self, slot: TensorSlot) -> None:
        """Point the parameter at the empty placeholder: a parameter has storage only
        while an operator uses it (what Release does, for a slot outside an operator)."""
        slot.param.data = self._placeholder
        if slot.span is not None:  # so does a span's parameter, with its pieces
            slot.span.unbind(self._placeholder)

    def check_working_sets(self, operators: Sequence[Sequence[TensorSlot]]) -> None:
        """Fail before training if one operator's chunks cannot fit on the device at all."""
        budget = self.residency.tiers[TierName.DEVICE].budget_bytes
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

    # -- moments and passes ---------------------------------------------------------------

    def begin_operator(self, name: str) -> None:
        """A new moment: an operator is about to start."""
        device = self.residency.tiers[TierName.DEVICE]
        low = device.compute_low_bytes
        # chunks on their way to the host still hold device memory: chunk memory, not
        # memory carried into the iteration
        chunks = self.residency.device_chunk_bytes()
        self.tracer.new_moment(name, chunks, device.new_window(), low)
        device.start_compute()  # until its chunks are in place (an operator without any)
        self.residency.tick()
        self.groups.note_operator()
        if self.phase is TrainingPhase.BACKWARD and self.backward_operator is not None:
            self.backward_operator()

    def end_pass(self) -> bool:
        """The iteration (or evaluation forward) is over: close the tracer's pass; True if
        it recorded a new trace (placement is then decided again from it)."""
        device = self.residency.tiers[TierName.DEVICE]
        self.tracer.close_window(device.new_window(), device.compute_low_bytes)
        traced = self.tracer.end_pass()
        if traced:
            # the 'static' policy keeps every optimizer state on the host
            trace = None if self.memory.policy == "static" else self.tracer.trace
            self.device_adam, self.margin_bytes = placement.place_optimizer_states(
                trace,
                self.lists,
                self.owned,
                device_budget_bytes=self.residency.tiers[TierName.DEVICE].budget_bytes,
                nproc=self.zero.nproc,
                chunk_size=self.plan.chunk_size,
                device=self.device,
                keep=self._continued_adam,
            )
            self._continued_adam = None
        return traced

    def placement_state(self) -> dict[str, Any]:
        """Where Adam runs for each chunk, for a checkpoint (see `placement.saved`)."""
        budget = self.residency.tiers[TierName.DEVICE].budget_bytes
        return placement.saved(self.device, budget, self.device_adam)

    def restore_placement(self, saved: dict[str, Any] | None) -> None:
        """Adam runs where it ran for the run a checkpoint continues: in the warm-up step,
        and after it while that fits, where the budget is the same (`placement.restored`)."""
        if self.tracer.trace is not None:
            return
        budget = self.residency.tiers[TierName.DEVICE].budget_bytes
        n = len(self.lists[ChunkType.PARAM])
        found = placement.restored(saved, self.device, budget, n)
        if found is not None:
            self.device_adam, same_budget = found
            self._continued_adam = set(self.device_adam) if same_budget else None

    def end_iteration(self) -> None:
        self.residency.end_iteration()

    # -- Access / Release (Algorithms 1 and 2) ------------------------------------------

    def access_slots(self, slots: Sequence[TensorSlot], forward: bool = False) -> None:
        """Algorithm 1 for every tensor one operator needs: gather the ZeRO groups, make
        the chunks resident on the device, then point each parameter at its slot."""
        with profiled("pstar::access"):
            chunks = list({id(c): c for c in (self.param_chunk(s) for s in slots)}.values())
            if self.zero.enabled:
                for c in chunks:
                    self.groups.gather(c)  # a no-op while its group is gathered
            # A tensor of this operator holding a gradient from an earlier micro-batch:
            # its chunk's gradients go to the accum chunk first (with ZeRO, before the
            # gather). Before the chunks are made resident: stashing allocates and may
            # evict another chunk of this operator, which must come back before a
            # parameter points at it.
            for s in slots:
                if s.state is TensorState.HOLD_AFTER_BWD:
                    self.grad_accum.stash(self.param_chunk(s))
            self.residency.make_resident(chunks, TierName.DEVICE, reading=self._reads(forward))
            self.residency.tiers[TierName.DEVICE].start_compute()
            self.residency.prefetch()
            if self.zero.enabled and self.zero.ahead:
                self._gather_next_group()
            for s in slots:
                chunk = self.param_chunk(s)
                if s.state is TensorState.FREE:
                    chunk.flat(s).zero_()
                s.set_state(TensorState.COMPUTE)
                s.compute_refs += 1
                if s.compute_refs == 1:
                    s.param.data = chunk.view(s)
                    if s.span is not None and s is s.span.pieces[-1]:
                        s.span.bind()  # the operator lists a span's pieces in order
                s.forward_uses += forward
        if self.on_access:
            for observe in self.on_access:
                observe(slots)

    def _gather_next_group(self) -> None:
        """The next group the trace uses that is not gathered: its gather starts now
        ([Note: gathers ahead] in groups.py). Every rank is at this moment of the same trace,
        so every rank asks for the same group."""
        for c in self.residency.upcoming(PARAM_LISTS, GATHER_AHEAD_MOMENTS):
            if self.groups.is_live(c):
                continue
            self.groups.gather_ahead(c)
            return

    @staticmethod
    def _reads(forward: bool) -> Callable[[Chunk], bool]:
        """Whether an operator only reads a chunk it accesses (its host copy stays
        current, see [Note: clean chunks] in transfers.py): a frozen chunk whose tensors
        all have values; a trainable one in forward, unless a tensor of it is zeroed at
        its first use or still holds a gradient."""

        def reads(c: Chunk) -> bool:
            if c.kind is ChunkType.FROZEN:
                return all(s.state is not TensorState.FREE for s in c.slots)
            return forward and all(s.state in _READ_IN_FORWARD for s in c.slots)

        return reads

    def release(self, slot: TensorSlot, target: TensorState) -> None:
        """Algorithm 2: the operator is done with `slot` (the last of its users sets
        `target` and drops the storage). Only a COMPUTE tensor can be released."""
        if slot.state is not TensorState.COMPUTE:
            raise RuntimeError(
                f"release of {slot.name} in state {slot.state.name}: only a tensor in COMPUTE "
                f"can be released (to {target.name})"
            )
        slot.compute_refs -= 1
        if slot.compute_refs > 0:
            return
        slot.set_state(target)
        self.drop_storage(slot)
        if self.zero.enabled and target is TensorState.HOLD_AFTER_FWD:
            self.groups.maybe_release(self.param_chunk(slot), backward=False)

    @staticmethod
    def _forward_done(s: TensorSlot) -> bool:
        # A tied weight is registered by several modules and used by each in forward:
        # its group stays gathered until the last of them has run.
        return s.state is TensorState.HOLD_AFTER_FWD and s.forward_uses >= len(s.aliases)

    def release_all(self, target: TensorState) -> None:
        """Force every COMPUTE tensor to `target` (end of forward/backward clean-up)."""
        for slot in self.slots:
            if slot.state is TensorState.COMPUTE:
                slot.compute_refs = 1
                self.release(slot, target)

    def grad_ready(self, slot: TensorSlot, grad: torch.Tensor) -> None:
        """Backward is done with `slot`: its gradient overwrites the param slot."""
        chunk = self.param_chunk(slot)
        if slot.state is not TensorState.COMPUTE:
            # A gradient for a tensor not accessed in backward (used outside its module's
            # forward): bring its chunk back first; the slot still holds the value.
            self.residency.make_resident([chunk], TierName.DEVICE)
            slot.set_state(TensorState.COMPUTE)
        self.residency.transfers.drop_host_copy(chunk)  # (a recomputed forward read it)
        chunk.view(slot).copy_(grad)
        slot.compute_refs = 0
        slot.set_state(TensorState.HOLD_AFTER_BWD)
        self.drop_storage(slot)
        if self.zero.enabled:
            self.groups.maybe_release(chunk, backward=True)

    def release_frozen_after_backward(self, slots: Sequence[TensorSlot]) -> None:
        """The gradients of an operator's inputs exist: backward is done with its frozen
        tensors (no gradient marks that moment for them), so they go back to HOLD and
        their chunks may leave the device, as a trainable chunk's may after its grads.
        Without this, a LoRA base would stay on the device until backward ends."""
        chunks = []
        for s in slots:
            if s.trainable or s.state is not TensorState.COMPUTE:
                continue
            self.release(s, TensorState.HOLD)
            if s.state is TensorState.HOLD:
                s.backward_done = True
                chunks.append(self.param_chunk(s))
        if self.zero.enabled:
            for c in {id(c): c for c in chunks}.values():
                self.groups.maybe_release(c, backward=True)

    def reset_after_forward(self) -> None:
        for slot in self.slots:
            slot.forward_uses = 0
            slot.backward_done = False
            if slot.state is TensorState.HOLD_AFTER_FWD:
                slot.set_state(TensorState.HOLD)

    def finish_forward(self) -> None:
        """End of forward: drop every group still gathered (same order on every rank)."""
        self.groups.finish(reduce=False)

    def finish_backward(self) -> None:
        """End of backward: reduce and drop the groups that some unused tensor kept open."""
        self.groups.finish(reduce=True)

    # -- optimizer ----------------------------------------------------------------------

    def prepare_adam(self, index: int) -> None:
        """Adam on chunk `index` is next: a moment, and its chunks together on its tier."""
        self.begin_operator(f"{placement.ADAM_MOMENT}{index}")
        chunks = [self.lists[k][index] for k in TRAINABLE_LISTS]
        acc = self.grad_accum.get(index)
        if acc is not None:
            chunks.append(acc)
        self.residency.make_resident(chunks, placement.adam_tier(self.device_adam, index))
        self.residency.tiers[TierName.DEVICE].start_compute()
        self.residency.prefetch()

    def adam_done(self, index: int) -> None:
        """Adam on chunk `index` is done. On the host, its updated parameters start back
        to the device (where the next forward reads them) while Adam runs on the next
        chunk, if there is room without evicting."""
        if placement.adam_tier(self.device_adam, index) == TierName.HOST:
            self.residency.send_ahead(self.lists[ChunkType.PARAM][index], TierName.DEVICE)

    def free_grad_accum(self) -> None:
        self.grad_accum.free(self.slots)

    def close(self) -> None:
        """Free every chunk on every tier and close the spill file."""
        self.free_grad_accum()
        self.groups.drop_all()
        for c in self.chunks():
            self.residency.forget(c)
        self.residency.close()
