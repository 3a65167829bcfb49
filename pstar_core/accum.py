"""Gradient accumulation across micro-batches, without a grad list.

[Note: gradient accumulation] After backward a trainable slot holds its gradient
(HOLD_AFTER_BWD), which is how the paper avoids a grad list. When the next micro-batch
accesses such a chunk before `step()`, its gradients are added into an fp32 GRAD_ACCUM
chunk (allocated then, freed by `step()`) and the parameter values are re-derived from
the fp32 master: the param chunk was produced by casting the master, so the re-derived
values are bitwise the ones the slot held. Cost: 4 bytes per trainable parameter of the
accessed chunks, only between the first re-access and the step;
`stats()["grad_accum_bytes"]` reports it.

The sums live where the chunk's Adam runs (`GradAccumulator.tier_for`), and gradients are
added in there: for host Adam, the chunk goes down with its gradients (which backward's
end sends anyway before Adam) and comes back with its parameters, as in a step of one
micro-batch; nothing fp32 crosses the link.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.residency import Residency
from pstar_core.tiers import DISK, HOST, TierName


class GradAccumulator:
    def __init__(
        self,
        residency: Residency,
        lists: dict[ChunkType, list[Chunk]],
        adam_tier: Callable[[Chunk], TierName],
    ) -> None:
        self.residency = residency
        self.lists = lists
        self.chunks: dict[int, Chunk] = {}  # trainable chunk index -> its accum chunk
        self.peak_bytes = 0
        self._adam_tier = adam_tier  # where Adam reads a chunk: its sums are kept there

    def tier_for(self, chunk: Chunk) -> TierName:
        """Where `chunk`'s sums live and its gradients are added in: where its Adam runs
        (the host for most chunks under a tight budget). A chunk on the device whose Adam
        runs on the host goes down with its gradients (2 bytes a parameter in bf16) rather
        than the master and the sums coming up (4 each, and the sums back again: D9 in
        GPU_NOTES)."""
        tier = self._adam_tier(chunk)
        return HOST if tier == DISK else tier

    def stash(self, chunk: Chunk) -> None:
        """Move the chunk's gradients into its fp32 accum chunk and restore the params."""
        r = self.residency
        acc = self.chunks.get(chunk.index)
        master = self.lists[ChunkType.PARAM_FP32][chunk.index]
        tier = self.tier_for(chunk)
        if acc is None:
            acc = Chunk(ChunkType.GRAD_ACCUM, chunk.index, chunk.capacity, torch.float32)
            r.reserve(tier, acc.nbytes, {id(chunk), id(master)})
            with r.tracer.chunk_memory():
                payload = r.tiers[tier].allocate(acc.capacity, acc.dtype).zero_()
            r.adopt(acc, payload, tier)
            self.chunks[chunk.index] = acc
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        r.make_resident([chunk, acc, master], tier)
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
