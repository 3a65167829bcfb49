"""Chunk-based ZeRO data parallelism: communication groups and their collectives.

The chunk lists are cut at the same positions on every rank. A communication group is
the nproc consecutive chunks `[g * nproc, (g + 1) * nproc)` of a list, and each rank owns
one chunk of every group: which one is decided once from the plan, the fullest chunk of
a group going to the rank that holds the least model data so far
(`mapping.balanced_owners`), so every rank holds 1/nproc of the model data within one
chunk per list, whatever the layout. A rank keeps only its own chunks of all lists.

Two variants move the same bytes:
- "collective": one all-gather of the group's param chunks before use, one
  reduce-scatter (sum, then divided by nproc) of their gradients after backward;
- "serial": the paper's memory-saving variant, nproc broadcasts (each owner sends its
  chunk) and nproc reductions to each owner, so the only buffer is the chunk itself.

Both need identical call order on every rank, which holds because every rank runs the
same model and so reaches the same access and release points (as in DDP, a parameter
used on one rank but not on another in the same step is not supported).
NCCL on GPU, gloo on CPU: the backend is the process group's. Only gloo runs here.

[Note: bytes sent] `bytes_sent` is counted from the tensors handed to each collective
call, at the call: what the standard algorithm makes this rank send for it (ring
all-gather: (N-1) x its input; ring reduce-scatter: (N-1) x its output shard; ring
all-reduce: 2 (N-1)/N x the tensor; broadcast and reduce: the tensor, sent by the source
once per peer in the worst case, (N-1) x, counted on the source only). Every collective
the engine issues goes through here, clipping norms and exports included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from pstar_core.chunk import Chunk, ChunkType, TensorState
from pstar_core.devices import check

S = TensorState


@dataclass
class ZeroGroup:
    """The process group and this rank's place in it."""

    group: dist.ProcessGroup | None
    rank: int
    nproc: int
    variant: str = "collective"  # or "serial"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # compute
    bytes_sent: int = 0  # see [Note: bytes sent]
    calls: dict[str, list[int]] = field(default_factory=dict)  # collective -> [calls, bytes]

    @classmethod
    def single(cls) -> ZeroGroup:
        return cls(None, 0, 1)

    @classmethod
    def from_default(
        cls, group: dist.ProcessGroup | None, variant: str, device: torch.device
    ) -> ZeroGroup:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1, device=device)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), variant, device)

    @property
    def enabled(self) -> bool:
        return self.nproc > 1

    def members(self, chunk_index: int) -> range:
        g = chunk_index // self.nproc
        return range(g * self.nproc, (g + 1) * self.nproc)

    # -- the engine's collectives ------------------------------------------------------

    def gather(self, own: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """outputs[r] receives rank r's chunk; outputs[self.rank] is `own` itself."""
        if self.variant == "serial":
            for r, out in enumerate(outputs):
                self._broadcast(out, r)
        else:
            self._sent("all_gather", own, self.nproc - 1)
            dist.all_gather(outputs, own, group=self.group)

    def reduce_scatter_mean(self, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """out = mean over ranks of inputs[self.rank] (inputs[r] is the group's chunk r)."""
        if self.variant == "serial":
            for r, t in enumerate(inputs):
                if r != self.rank:
                    self._sent("reduce", t, 1)  # this rank's part goes to owner r
                dist.reduce(t, dst=self._global(r), op=dist.ReduceOp.SUM, group=self.group)
            out.copy_(inputs[self.rank])
        else:
            self._sent("reduce_scatter", out, self.nproc - 1)
            dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=self.group)
        out.div_(self.nproc)

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL: not CPU
        self._all_reduce(t)
        return float(t.item())

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self._broadcast(t, src)

    def all_reduce_mean_(self, t: torch.Tensor) -> None:
        self._all_reduce(t)
        t.div_(self.nproc)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # -- counted wrappers -------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if src == self.rank:
            self._sent("broadcast", t, self.nproc - 1)
        dist.broadcast(t, src=self._global(src), group=self.group)

    def _all_reduce(self, t: torch.Tensor) -> None:
        self._sent("all_reduce", t, 2 * (self.nproc - 1) / self.nproc)
        dist.all_reduce(t, group=self.group)

    def _sent(self, name: str, t: torch.Tensor, times: float) -> None:
        check(
            t.device == self.device,
            f"{name} handed a tensor on {t.device}; collectives take the compute device's "
            f"({self.device})",
        )
        n = int(t.numel() * t.element_size() * times)
        self.bytes_sent += n
        entry = self.calls.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += n

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank


class GatheredGroups:
    """The life of communication groups in one rank (the paper's ZeRO over chunks).

    Before an operator uses a chunk whose group is not here, the group is all-gathered:
    the own chunk and the remote ones are pinned on the device, remote chunks arriving in
    HOLD. When every tensor of the group has finished its forward (HOLD_AFTER_FWD, tied
    weights counted) or its backward (HOLD_AFTER_BWD), the group is released: after
    backward its gradients are first reduce-scattered (averaged) into the owner's chunk;
    then the remote chunks are dropped. Gradients a chunk still holds from an earlier
    micro-batch are stashed by their owner before the gather overwrites them.
    """

    def __init__(self, zero: ZeroGroup, lists, owner, residency, stash, forward_done) -> None:
        self.zero = zero
        self.lists = lists  # ChunkType -> chunks
        self.owner = owner  # chunk -> rank
        self.residency = residency
        self.stash = stash  # gradient accumulation: chunk -> None
        self.forward_done = forward_done  # slot -> its forward is over (tied weights too)
        # gathered groups, by (list, group index), members in owner order
        self.live: dict[tuple[ChunkType, int], list[Chunk]] = {}

    def _key(self, c: Chunk) -> tuple[ChunkType, int]:
        return (c.kind, c.index // self.zero.nproc)

    def _members(self, c: Chunk) -> list[Chunk]:
        """The communication group of `c`, ordered by owner rank (as collectives order)."""
        members = [self.lists[c.kind][i] for i in self.zero.members(c.index)]
        return sorted(members, key=self.owner)

    def gather(self, c: Chunk) -> None:
        """All-gather the group of `c` (a no-op while it is gathered)."""
        key = self._key(c)
        if key in self.live:
            return
        members = self._members(c)
        own = members[self.zero.rank]
        for m in members:
            if any(s.state is S.HOLD_AFTER_BWD for s in m.slots):
                if m is own:
                    self.stash(m)
                else:  # its owner moves those grads out of the way in its own stash
                    for s in m.slots:
                        if s.state is S.HOLD_AFTER_BWD:
                            s.set_state(S.HOLD)
        remote = [m for m in members if m is not own]
        r = self.residency
        r.make_resident([own], "device")
        own.pins += 1
        check(
            own.tier == "device", f"{_name(own)} goes into an all-gather from the {own.tier} tier"
        )
        r._make_room("device", sum(m.nbytes for m in remote), {id(m) for m in members})
        device = r.tiers["device"]
        with r.tracer.chunk_memory(), record_function("pstar::all_gather"):
            for m in remote:
                r.adopt(m, device.allocate(m.capacity, m.dtype), "device")
                m.pins += 1
            self.zero.gather(own.payload, [m.payload for m in members])
        self.live[key] = members
        for m in remote:
            r.tracer.note_use((m.kind.value, m.index))

    def maybe_release(self, c: Chunk, backward: bool) -> None:
        """Release the group of `c` if all its tensors are done with this pass."""
        key = self._key(c)
        members = self.live.get(key)
        if members is None:
            return
        done = (lambda s: s.state is S.HOLD_AFTER_BWD) if backward else self.forward_done
        if all(done(s) for m in members for s in m.slots):
            self._release(key, reduce=backward)

    def _release(self, key: tuple[ChunkType, int], reduce: bool) -> None:
        """Reduce-scatter the group's grads (after backward), then drop remote chunks."""
        members = self.live.pop(key)
        own = members[self.zero.rank]
        if reduce and key[0] is ChunkType.PARAM:
            self._reduce(members, own)
        for m in members:
            m.pins -= 1
            if m is not own:
                self.residency.forget(m)

    def _reduce(self, members: list[Chunk], own: Chunk) -> None:
        from pstar_core.chunk import ChunkType

        # Slots without a gradient hold parameter values: send zeros for them, and
        # restore the owner's values from its fp32 master afterwards.
        for m in members:
            for s in m.slots:
                if s.state is not S.HOLD_AFTER_BWD:
                    m.flat(s).zero_()
        r = self.residency
        for m in members:
            check(
                m.tier == "device", f"{_name(m)} goes into a reduce-scatter from the {m.tier} tier"
            )
        with r.tracer.chunk_memory():
            out = r.tiers["device"].allocate(own.capacity, own.dtype)
        with record_function("pstar::reduce_scatter"):
            self.zero.reduce_scatter_mean([m.payload for m in members], out)
        own.payload.copy_(out)
        master = self.lists[ChunkType.PARAM_FP32][own.index]
        for s in own.slots:
            if s.state is not S.HOLD_AFTER_BWD:
                r.in_memory(master)
                own.flat(s).copy_(master.flat(s))

    def finish(self, reduce: bool) -> None:
        """End of forward (drop) or backward (reduce, then drop): every group still here,
        in the same order on every rank."""
        for key in sorted(self.live, key=lambda k: (k[0].value, k[1])):
            self._release(key, reduce=reduce)

    def drop_all(self) -> None:
        """Drop every gathered group without collectives or a reduction (an abandoned
        iteration: its gradients are dropped anyway)."""
        for members in self.live.values():
            own = members[self.zero.rank]
            for m in members:
                m.pins -= 1
                if m is not own:
                    self.residency.forget(m)
        self.live.clear()


def _name(c: Chunk) -> str:
    return f"{c.kind.value} chunk {c.index}"
