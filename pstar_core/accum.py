"""Gradient accumulation across micro-batches, without a grad list.

[Note: gradient accumulation] After backward a trainable slot holds its gradient
(HOLD_AFTER_BWD), which is how the paper avoids a grad list. When the next micro-batch
accesses such a chunk before `step()`, its gradients are added into an fp32 GRAD_ACCUM
chunk (allocated then, freed by `step()`) and the parameter values are re-derived from
the fp32 master: the param chunk was produced by casting the master, so the re-derived
values are bitwise the ones the slot held. Cost: 4 bytes per trainable parameter of the
accessed chunks, only between the first re-access and the step;
`stats()["grad_accum_bytes"]` reports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.residency import Residency


class GradAccumulator:
    def __init__(self, residency: Residency, lists: dict[ChunkType, list[Chunk]]) -> None:
        self.residency = residency
        self.lists = lists
        self.chunks: dict[int, Chunk] = {}  # trainable chunk index -> its accum chunk
        self.peak_bytes = 0

    def stash(self, chunk: Chunk) -> None:
        """Move the chunk's gradients into its fp32 accum chunk and restore the params."""
        r = self.residency
        acc = self.chunks.get(chunk.index)
        master = self.lists[ChunkType.PARAM_FP32][chunk.index]
        if acc is None:
            acc = Chunk(ChunkType.GRAD_ACCUM, chunk.index, chunk.capacity, torch.float32)
            r.reserve(chunk.tier, acc.nbytes, {id(chunk), id(master)})
            with r.tracer.chunk_memory():
                payload = r.tiers[chunk.tier].allocate(acc.capacity, acc.dtype).zero_()
            r.adopt(acc, payload, chunk.tier)
            self.chunks[chunk.index] = acc
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        r.colocate([chunk, acc, master])
        for s in chunk.slots:
            if s.state is TensorState.HOLD_AFTER_BWD:
                acc.flat(s).add_(chunk.flat(s))
                chunk.flat(s).copy_(master.flat(s))
                s.grad_in_accum = True
                s.set_state(TensorState.HOLD)

    def get(self, index: int) -> Chunk | None:
        return self.chunks.get(index)

    def values(self) -> Iterable[Chunk]:
        return self.chunks.values()

    def __bool__(self) -> bool:
        return bool(self.chunks)

    @property
    def bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks.values())

    def free(self, slots: Iterable[TensorSlot]) -> None:
        """`step()` consumed the sums: free the accum chunks."""
        for acc in self.chunks.values():
            with self.residency.tracer.chunk_memory():
                self.residency.forget(acc)
        self.chunks.clear()
        for s in slots:
            s.grad_in_accum = False
