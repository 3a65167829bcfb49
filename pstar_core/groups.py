"""A rank's ZeRO communication groups over their life: gathered before use (or ahead of
it), reduced after backward, released; see `zero.ZeroGroup` for the collectives
themselves and [Note: ranks fail together] there for how every rank agrees on each."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.devices import capabilities, check
from pstar_core.tiers import TierName
from pstar_core.tracer import profiled
from pstar_core.zero import Op, Work, ZeroGroup


class InFlight(NamedTuple):
    """A reduce-scatter issued and not yet waited on, with the group it reduces."""

    work: Work
    members: list[Chunk]  # the group in owner order, slices of one buffer
    own: Chunk


class GatheredGroups:
    """The life of communication groups in one rank (the paper's ZeRO over chunks).

    Before an operator uses a chunk whose group is not here, the group is all-gathered:
    the own chunk and the remote ones are pinned on the device, remote chunks arriving in
    HOLD. When every tensor of the group has finished its forward (HOLD_AFTER_FWD, tied
    weights counted) or its backward (HOLD_AFTER_BWD), the group is released: after
    backward its gradients are first reduce-scattered (averaged) into the owner's chunk;
    then the remote chunks are dropped. Gradients a chunk still holds from an earlier
    micro-batch are stashed by their owner before the gather overwrites them.

    [Note: one buffer per gathered group] In the "collective" variant on a device a
    gathered group lives in one contiguous buffer of nproc chunks in owner order: the own
    chunk's payload moves into its slice (a device-to-device copy; its old buffer is
    freed, so the group costs nproc chunks, not nproc + 1), remote chunks are the other
    slices, and both collectives run in place on it (`all_gather_single`,
    `reduce_scatter_single`), the shapes NCCL handles without temporaries. When the group
    is released the own chunk is copied back into a buffer of its own and the group buffer
    goes. On the CPU (gloo) the list forms run on separate chunks instead: gloo copies
    through a flat temporary either way (measured with the profiler: its single-tensor
    reduce-scatter clones the whole group, the list form one chunk), and the copies in and
    out of the buffer made a 2-rank step about 10% slower there.

    [Note: overlapped reductions] After backward a group's reduce-scatter is issued
    asynchronously and the backward of the next layers runs while it is in flight, their
    groups' gathers included; it is waited on (`settle`) before its own group is gathered
    again (accumulation), at the end of backward, or when the device needs the memory its
    buffer holds (the manager gives `settle` to `Residency`,
    which calls it when nothing is left to evict). Collectives are issued at the same
    points on every rank; only the waits move, so the order every rank sees is unchanged.
    """

    def __init__(self, zero: ZeroGroup, lists, owner, residency, stash, forward_done) -> None:
        self.zero = zero
        # own chunk -> its reduced gradients go to the host now, for Adam beside backward
        # (set by `beside.AdamBesideBackward`): they leave the group's buffer by a copy
        # out, not a device copy
        self.for_host_adam: Callable[[Chunk], bool] = lambda c: False
        self.lists = lists  # ChunkType -> chunks
        self.owner = owner  # chunk -> rank
        self.residency = residency
        self.stash = stash  # gradient accumulation: chunk -> None
        self.forward_done = forward_done  # slot -> its forward is over (tied weights too)
        # gathered groups, by (list, group index), members in owner order
        self.live: dict[tuple[ChunkType, int], list[Chunk]] = {}
        self.in_flight: list[InFlight] = []  # reduce-scatters issued, oldest first
        self.arriving: dict[tuple[ChunkType, int], Work] = {}  # gathers issued ahead
        self.gathered_ahead = 0  # groups gathered ahead of their use, in total
        self.ahead_made_room = 0  # ... of which an agreed script asked without room here
        self._buffers: dict[int, torch.Tensor] = {}  # own chunk id -> its group's buffer
        self.evicted_under_pressure = 0  # own chunks sent to the host by a pressed settle

    @property
    def contiguous(self) -> bool:
        """One buffer per gathered group: on a device (see the note above)."""
        return self.zero.variant == "collective" and capabilities(self.zero.device).accelerator

    def _key(self, c: Chunk) -> tuple[ChunkType, int]:
        return (c.kind, c.index // self.zero.nproc)

    def _members(self, c: Chunk) -> list[Chunk]:
        """The communication group of `c`, ordered by owner rank (as collectives order)."""
        members = [self.lists[c.kind][i] for i in self.zero.members(c.index)]
        return sorted(members, key=self.owner)

    def gather(self, c: Chunk) -> None:
        """All-gather the group of `c` (a no-op while it is gathered).

        Everything this rank needs for the collective is made before the collective's
        flag (see [Note: ranks fail together]): a rank that cannot stash, make room or
        allocate the group fails before any rank enters the all-gather, and the others
        learn it at the flag, instead of waiting in a collective it never issues."""
        key = self._key(c)
        if key in self.live:
            self._arrive(key)
            return
        # a group reduced a moment ago may be gathered again (accumulation): its own
        # reduction is waited for; the others' go on under this gather and the compute
        # after it, until the end of backward or until the device needs their memory
        self.settle(key)
        members = self._members(c)
        own = members[self.zero.rank]
        for m in members:
            if any(s.state is TensorState.HOLD_AFTER_BWD for s in m.slots):
                if m is own:
                    self.stash(m)
                else:  # its owner moves those grads out of the way in its own stash
                    for s in m.slots:
                        if s.state is TensorState.HOLD_AFTER_BWD:
                            s.set_state(TensorState.HOLD)
        self._make_room(members, own, sum(m.nbytes for m in members if m is not own))
        remote = [m for m in members if m is not own]
        r = self.residency
        serial = self.zero.variant == "serial"
        op = Op("broadcast" if serial else "all_gather", own.kind.value, key[1], own.capacity)
        with r.tracer.chunk_memory(), profiled("pstar::all_gather"):
            outputs = self._allocate(members, own)
            self._open(key, members, own, outputs)
            if serial:
                self.zero.broadcast_each([m.payload for m in members], op)
            else:
                self.zero.all_gather(self._outputs(members, own), own.payload, op)
        for m in remote:
            r.tracer.note_use((m.kind.value, m.index))

    def _make_room(self, members: list[Chunk], own: Chunk, need: int) -> None:
        """Before a group's gather: its own chunk on the device, and `need` bytes free
        there for the rest (evicting other chunks if it must)."""
        r = self.residency
        r.make_resident([own], TierName.DEVICE)
        check(
            own.tier == TierName.DEVICE,
            f"{_name(own)} goes into an all-gather from the {own.tier} tier",
        )
        r.reserve(TierName.DEVICE, need, {id(m) for m in members})

    def _allocate(self, members: list[Chunk], own: Chunk) -> list[torch.Tensor]:
        """The device memory a gathered group needs: its one buffer, or a chunk for each
        remote member."""
        device = self.residency.tiers[TierName.DEVICE]
        if self.contiguous:
            return [device.allocate(own.capacity * self.zero.nproc, own.dtype)]
        return [device.allocate(m.capacity, m.dtype) for m in members if m is not own]

    def _open(
        self, key: tuple[ChunkType, int], members: list[Chunk], own: Chunk, got: list
    ) -> None:
        """The group is gathered from here on (an iteration abandoned at the flag drops
        it: `drop_all`): its members pinned, remote ones given the memory `got`."""
        r = self.residency
        for m in members:
            m.pins += 1
        self.live[key] = members
        remote = [m for m in members if m is not own]
        if self.contiguous:
            (buffer,) = got
            slices = list(buffer.chunk(self.zero.nproc))
            slices[self.zero.rank].copy_(own.payload)
            r.rehome(own, slices[self.zero.rank])
            self._buffers[id(own)] = buffer
            for m, part in zip(members, slices, strict=True):
                if m is not own:
                    r.adopt(m, part, TierName.DEVICE)
        else:
            for m, part in zip(remote, got, strict=True):
                r.adopt(m, part, TierName.DEVICE)

    def _outputs(self, members: list[Chunk], own: Chunk) -> torch.Tensor | list[torch.Tensor]:
        return self._buffers[id(own)] if self.contiguous else [m.payload for m in members]

    def settled(self, c: Chunk) -> bool:
        """Whether nothing is under way on the group of `c`: not gathered, no gather
        ahead, no reduction in flight (its own chunk holds its reduced gradients)."""
        key = self._key(c)
        if key in self.live or key in self.arriving:
            return False
        return all(self._key(f.own) != key for f in self.in_flight)

    def is_live(self, c: Chunk) -> bool:
        """Whether the group of `c` is gathered (or its gather issued)."""
        return self._key(c) in self.live

    def gather_ahead(self, c: Chunk) -> bool:
        """[Note: gathers ahead] While an operator computes, the group of `c` (the next
        one the trace uses) is all-gathered asynchronously, as FSDP2 prefetches its next
        unit, and its operator waits for the work instead of the whole collective. Every
        rank calls this at the same moment (they follow the same trace), and the group
        is gathered only if every rank has room for it without evicting: each says so in
        the gather's flag (`agree_ahead`), having allocated the memory already, and gives
        it back if some rank could not (that group is gathered at its use, as before).
        In a section on an agreed script the script decides instead, with no exchange,
        and a rank without room makes it (see [Note: agreed sections] in zero.py). A
        group with gradients to stash first is left to its use (every rank's slots agree
        on that). One whose reduction is still in flight here counts as no room: whether
        it is can differ between ranks (a settle at the device's limit, or Adam beside
        backward finishing the reductions found done), so it is said in the flag, not
        decided alone. Called with `zero.ahead` on (the manager asks). True if the
        gather was issued."""
        key = self._key(c)
        if self.zero.variant != "collective" or key in self.live:
            return False
        members = self._members(c)
        if any(s.state is TensorState.HOLD_AFTER_BWD for m in members for s in m.slots):
            return False
        reducing = any(self._key(f.own) == key for f in self.in_flight)
        own = members[self.zero.rank]
        r = self.residency
        need = sum(m.nbytes for m in members if m is not own)
        need += own.nbytes if self.contiguous else 0  # its copy into the group's buffer
        device = r.tiers[TierName.DEVICE]
        can = (
            not reducing
            and own.tier == TierName.DEVICE
            and device.used_bytes + r.transfers.sending_bytes + need <= r.allowed(TierName.DEVICE)
        )
        op = Op("all_gather", own.kind.value, key[1], own.capacity)
        got: list[torch.Tensor] = []
        with r.tracer.chunk_memory():
            if can:
                r.transfers.arrive(own)  # a copy in may still be writing it
                got = self._allocate(members, own)
            if not self.zero.agree_ahead(op, can, own.dtype):
                for t in got:
                    device.release(t)
                return False
        if not got:  # the agreed script gathers it here: room first, as at a use
            self.ahead_made_room += 1
            self.settle(key)  # its reduction here, if still in flight
            self._make_room(members, own, need)
            r.transfers.arrive(own)
            with r.tracer.chunk_memory():
                got = self._allocate(members, own)
        with r.tracer.chunk_memory(), profiled("pstar::all_gather ahead"):
            self._open(key, members, own, got)
            work = self.zero.all_gather(self._outputs(members, own), own.payload, op, True)
        self.arriving[key] = work
        self.gathered_ahead += 1
        return True

    def _arrive(self, key: tuple[ChunkType, int]) -> None:
        """Wait for the group's gather if it was issued ahead."""
        work = self.arriving.pop(key, None)
        if work is not None:
            with profiled("pstar::wait all_gather"):
                work.wait()

    def maybe_release(self, c: Chunk, backward: bool) -> None:
        """Release the group of `c` if all its tensors are done with this pass."""
        key = self._key(c)
        members = self.live.get(key)
        if members is None:
            return
        done = self._backward_done if backward else self.forward_done
        if all(done(s) for m in members for s in m.slots):
            self._release(key, reduce=backward)

    @staticmethod
    def _backward_done(s: TensorSlot) -> bool:
        # a trainable tensor is done when its gradient sits in the slot, a frozen one
        # when the gradients of its operator's inputs exist
        return s.state is TensorState.HOLD_AFTER_BWD or (
            s.state is TensorState.HOLD and s.backward_done
        )

    def _release(self, key: tuple[ChunkType, int], reduce: bool) -> None:
        """Reduce-scatter the group's grads (after backward), then drop remote chunks."""
        self._arrive(key)
        members = self.live.pop(key)
        own = members[self.zero.rank]
        if reduce and key[0] is ChunkType.PARAM:
            self._reduce(members, own)
        else:
            self._drop(members, own)

    def _drop(
        self, members: list[Chunk], own: Chunk, pressed: bool = False, reduced: bool = False
    ) -> None:
        """The group leaves: remote chunks are forgotten, the own chunk keeps its bytes
        in a buffer of its own (`pressed`: on the host, see [Note: leaving the group
        buffer]). Reduced gradients bound for Adam beside backward go to the host by a
        copy out instead, the group's buffer held on the device until it is done."""
        for m in members:
            m.pins -= 1
        buffer = self._buffers.pop(id(own), None)
        r = self.residency
        if reduced and not pressed and self.for_host_adam(own):
            held = buffer.nbytes if buffer is not None else own.nbytes
            if r.transfers.send(own, held):
                buffer = None
        if buffer is not None:
            self._leave_buffer(own, members, pressed)
        for m in members:
            if m is not own:
                self.residency.forget(m)

    def _leave_buffer(self, own: Chunk, members: list[Chunk], pressed: bool) -> None:
        """[Note: leaving the group buffer] The own chunk is a slice of the group's buffer,
        which lives while any slice does, so its bytes move to a chunk of their own first:
        for that copy the device holds the group and one chunk more. In an iteration that
        follows the trace that moment is measured (the allocator's peak is in its N_i).
        But a group settled because the device is at its limit (`Residency.reserve` found
        nothing to evict and waits for reductions in flight to free their buffers) would
        allocate a chunk beyond the limit, where a real allocator can run out of memory:
        there the own chunk goes to the host instead, as the eviction that reserve was
        looking for, and the whole group's memory comes free."""
        r = self.residency
        if pressed:
            self.evicted_under_pressure += 1
            r.move(own, TierName.HOST, {id(m) for m in members})
            return
        with r.tracer.chunk_memory():
            alone = r.tiers[TierName.DEVICE].allocate(own.capacity, own.dtype)
            alone.copy_(own.payload)
            r.rehome(own, alone)

    def _reduce(self, members: list[Chunk], own: Chunk) -> None:
        # Slots without a gradient hold parameter values: send zeros for them, and
        # restore the owner's values from its fp32 master afterwards.
        for m in members:
            for s in m.slots:
                if s.state is not TensorState.HOLD_AFTER_BWD:
                    m.flat(s).zero_()
        r = self.residency
        for m in members:
            check(
                m.tier == TierName.DEVICE,
                f"{_name(m)} goes into a reduce-scatter from the {m.tier} tier",
            )
        group = own.index // self.zero.nproc
        if self.zero.variant == "serial":
            with r.tracer.chunk_memory():
                out = r.tiers[TierName.DEVICE].allocate(own.capacity, own.dtype)
            op = Op("reduce", own.kind.value, group, own.capacity)
            with profiled("pstar::reduce_scatter"):
                self.zero.reduce_each_mean([m.payload for m in members], out, op)
            own.payload.copy_(out)
            self._finish_reduce(members, own, averaged=True)
            return
        # in place: own is its slice of the group's buffer, or its entry in the list
        inputs = self._buffers[id(own)] if self.contiguous else [m.payload for m in members]
        op = Op("reduce_scatter", own.kind.value, group, own.capacity)
        with profiled("pstar::reduce_scatter"):
            work = self.zero.reduce_scatter_sum(own.payload, inputs, op)
        self.in_flight.append(InFlight(work, members, own))
        if not self.zero.overlap:
            self.settle()

    def note_operator(self) -> None:
        """An operator starts: reductions still in flight now overlap its compute."""
        self.zero.overlapped += len(self.in_flight)

    def _finish_reduce(
        self, members: list[Chunk], own: Chunk, averaged: bool = False, pressed: bool = False
    ) -> None:
        r = self.residency
        if not averaged:
            own.payload.div_(self.zero.nproc)
        master = self.lists[ChunkType.PARAM_FP32][own.index]
        for s in own.slots:
            if s.state is not TensorState.HOLD_AFTER_BWD:
                r.in_memory(master)
                own.flat(s).copy_(master.flat(s))
        self._drop(members, own, pressed, reduced=True)

    def settle_completed(self) -> None:
        """Finish, without waiting, the reductions in flight whose collective is done and
        whose own chunk's gradients go to the host for Adam beside backward (`beside.py`):
        they leave for the host now, not at the end of backward."""
        for f in [f for f in self.in_flight if self.for_host_adam(f.own)]:
            if f.work.is_completed():
                self.settle(self._key(f.own))

    def settle(self, key: tuple[ChunkType, int] | None = None, pressed: bool = False) -> bool:
        """Wait for the reductions in flight (of the group `key` only, if given) and
        release their groups; True if any was. `pressed`: the device has no room left
        (see [Note: leaving the group buffer])."""
        pending = [f for f in self.in_flight if key is None or self._key(f.own) == key]
        if not pending:
            return False
        waited = {id(f) for f in pending}
        self.in_flight = [f for f in self.in_flight if id(f) not in waited]
        for work, members, own in pending:
            with profiled("pstar::wait reduce_scatter"):
                work.wait()
            self._finish_reduce(members, own, pressed=pressed)
        return True

    def finish(self, reduce: bool) -> None:
        """End of forward (drop) or backward (reduce, then drop): every group still here,
        in the same order on every rank."""
        for key in sorted(self.live, key=lambda k: (k[0].value, k[1])):
            self._release(key, reduce=reduce)
        self.settle()

    def drop_all(self) -> None:
        """Drop every gathered group without collectives or a reduction (an abandoned
        iteration: its gradients are dropped anyway)."""
        for work, members, own in self.in_flight:
            work.wait()  # the buffer may not go while a collective writes it
            self._drop(members, own)
        self.in_flight.clear()
        for work in self.arriving.values():
            work.wait()
        self.arriving.clear()
        for members in self.live.values():
            self._drop(members, members[self.zero.rank])
        self.live.clear()


def _name(c: Chunk) -> str:
    return f"{c.kind.value} chunk {c.index}"
