"""`ChunkManager`: owns the chunk lists and drives the paper's Access and Release.

Access(param) makes the param chunk usable, points `param.data` at the slot and sets
COMPUTE; Release(param, state) sets the HOLD-like state and points `param.data` at an
empty placeholder, so a parameter has real storage only while an operator needs it.

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
from collections.abc import Iterable

import torch

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.mapping import Plan

log = logging.getLogger(__name__)

S = TensorState
TRAINABLE_LISTS = (ChunkType.PARAM, ChunkType.PARAM_FP32, ChunkType.MOMENTUM, ChunkType.VARIANCE)


class ChunkManager:
    def __init__(self, plan: Plan, dtype: torch.dtype, device: torch.device) -> None:
        self.plan = plan
        self.dtype = dtype
        self.device = device
        size = plan.chunk_size
        n_tr, n_fr = plan.trainable.num_chunks, plan.frozen.num_chunks
        dtypes = {ChunkType.PARAM: dtype, ChunkType.FROZEN: dtype}
        self.lists: dict[ChunkType, list[Chunk]] = {
            kind: [Chunk(kind, i, size, dtypes.get(kind, torch.float32)) for i in range(n)]
            for kind, n in [(k, n_tr) for k in TRAINABLE_LISTS] + [(ChunkType.FROZEN, n_fr)]
        }
        self.grad_accum: dict[int, Chunk] = {}
        self.slots: list[TensorSlot] = []
        # Released parameters point here: zero elements, so a stray use fails loudly
        # instead of reading stale memory, while dtype and device stay truthful.
        self._placeholder = torch.empty(0, dtype=dtype, device=device)
        self.bytes_moved: dict[str, int] = {}
        self.peak_grad_accum_bytes = 0

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

    def allocate_all(self) -> None:
        """Give every chunk memory on the compute device (zeros: FREE tensors read as 0)."""
        for chunks in self.lists.values():
            for c in chunks:
                if c.payload is None:
                    c.payload = torch.zeros(c.capacity, dtype=c.dtype, device=self.device)

    def chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        for kind, chunks in self.lists.items():
            if kinds is None or kind in kinds:
                yield from chunks

    # -- Access / Release (Algorithms 1 and 2) ------------------------------------------

    def access(self, slot: TensorSlot) -> None:
        chunk = self.param_chunk(slot)
        if slot.state is S.HOLD_AFTER_BWD:
            self._stash_grads(chunk)
        if slot.state is S.FREE:
            chunk.flat(slot).zero_()
        slot.set_state(S.COMPUTE)
        slot.compute_refs += 1
        if slot.compute_refs == 1:
            slot.param.data = chunk.view(slot)

    def release(self, slot: TensorSlot, target: TensorState) -> None:
        if slot.state is not S.COMPUTE:
            return  # a module re-entered after its tensors were released; nothing to do
        slot.compute_refs -= 1
        if slot.compute_refs > 0:
            return
        slot.set_state(target)
        slot.param.data = self._placeholder

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
            # Only reachable when a gradient arrives for a tensor not accessed in backward
            # (e.g. used outside its module's forward); its slot still holds the value.
            slot.set_state(S.COMPUTE)
        chunk.view(slot).copy_(grad)
        slot.compute_refs = 0
        slot.set_state(S.HOLD_AFTER_BWD)
        slot.param.data = self._placeholder

    def reset_after_forward(self) -> None:
        for slot in self.slots:
            if slot.state is S.HOLD_AFTER_FWD:
                slot.set_state(S.HOLD)

    # -- gradient accumulation ----------------------------------------------------------

    def _stash_grads(self, chunk: Chunk) -> None:
        """Move the chunk's gradients into its fp32 accum chunk and restore the params."""
        acc = self.grad_accum.get(chunk.index)
        if acc is None:
            acc = Chunk(ChunkType.GRAD_ACCUM, chunk.index, chunk.capacity, torch.float32)
            acc.payload = torch.zeros(chunk.capacity, dtype=torch.float32, device=self.device)
            self.grad_accum[chunk.index] = acc
            self.peak_grad_accum_bytes = max(self.peak_grad_accum_bytes, self.grad_accum_bytes)
        master = self.lists[ChunkType.PARAM_FP32][chunk.index]
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
        self.grad_accum.clear()
        for s in self.slots:
            s.grad_in_accum = False

    # -- accounting ----------------------------------------------------------------------

    def count_move(self, direction: str, nbytes: int) -> None:
        self.bytes_moved[direction] = self.bytes_moved.get(direction, 0) + nbytes
