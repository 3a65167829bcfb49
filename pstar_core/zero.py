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
used on one rank but not on another in the same step is not supported, and is caught:
see [Note: collective order]).
NCCL on GPU, gloo on CPU: the backend is the process group's.

[Note: torch releases] The in-place single-buffer collectives are called by the name the
running torch has: `all_gather_single` / `reduce_scatter_single` (torch 2.13's names),
else `all_gather_into_tensor` / `reduce_scatter_tensor` (the same signatures, in every
release this engine supports). GPU images ship the torch their CUDA was built with, so
nothing here may need a newer one.

[Note: bytes sent] `bytes_sent` is counted from the tensors handed to each collective
call, at the call: what the standard algorithm makes this rank send for it (ring
all-gather: (N-1) x its input; ring reduce-scatter: (N-1) x its output shard; ring
all-reduce: 2 (N-1)/N x the tensor; broadcast and reduce: the tensor, sent by the source
once per peer in the worst case, (N-1) x, counted on the source only). Every collective
the engine issues goes through here, clipping norms and exports included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.devices import capabilities, check
from pstar_core.tiers import TierName
from pstar_core.tracer import profiled

Work = dist.Work


class RankFailed(RuntimeError):
    """Another rank's iteration failed: every rank gives up the same iteration (see
    [Note: ranks fail together]); the message carries the failing rank's error."""


class CollectiveMismatch(RankFailed):
    """The ranks reached different collectives at the same point (see [Note: collective
    order]); every rank raises it, naming what each one was about to issue."""


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False):
    """`out` (nproc x `inp`, in rank order) gathered in place (see [Note: torch releases])."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool):
    """`out` = the sum over ranks of this rank's slice of `inp` (see [Note: torch releases])."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


_OP_KINDS = ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce", "barrier")
_OP_LISTS = tuple(k.value for k in ChunkType)


class Op(NamedTuple):
    """A collective as the ranks must agree on it (see [Note: collective order])."""

    kind: str  # one of _OP_KINDS
    chunks: str = ""  # the chunk list of a group's collective ("param", "frozen"), or ""
    group: int = -1  # the communication group's index in that list
    numel: int = 0  # elements each rank contributes

    def codes(self) -> list[int]:
        chunks = _OP_LISTS.index(self.chunks) + 1 if self.chunks else 0
        return [_OP_KINDS.index(self.kind) + 1, chunks, self.group + 1, self.numel]

    @classmethod
    def of(cls, codes: list[int]) -> Op:
        kind, chunks, group, numel = codes
        if not 0 < kind <= len(_OP_KINDS):
            return cls("none")
        return cls(_OP_KINDS[kind - 1], _OP_LISTS[chunks - 1] if chunks else "", group - 1, numel)

    def __str__(self) -> str:
        where = f" of {self.chunks} group {self.group}" if self.chunks else ""
        return f"{self.kind}{where} ({self.numel} elements)"


_CODES = len(Op("barrier").codes())


@dataclass
class ZeroGroup:
    """The process group and this rank's place in it.

    [Note: ranks fail together] Every rank must issue the same collectives in the same
    order. When one rank's iteration fails (an exception in its forward, an out-of-memory
    on its device, or the caller's code between engine calls), the others would go on
    into collectives it never issues: equal-sized all-gathers would then exchange
    different groups, or hang. So every collective the engine issues is preceded by an
    all-reduce (max) of a failure flag on a gloo group (host memory: no device sync), and
    a failing rank, instead of abandoning alone, joins the others' next flag all-reduce
    with its rank: all ranks then learn who failed and why (the message is broadcast),
    and all give up the same iteration. Collectives are blocking or ordered per group, so
    the flag all-reduce a failing rank joins is always the one the others are waiting in
    or will reach next. A failure inside a collective itself (a lost peer) is not
    reported: the others' collective fails as well.
    """

    group: dist.ProcessGroup | None
    rank: int
    nproc: int
    variant: str = "collective"  # or "serial"
    overlap: bool = False  # reductions in flight while backward goes on (collective only)
    ahead: bool = False  # the next group gathered while an operator computes
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # compute
    bytes_sent: int = 0  # see [Note: bytes sent]
    overlapped: int = 0  # reductions still in flight when the next operator began
    calls: dict[str, list[int]] = field(default_factory=dict)  # collective -> [calls, bytes]
    # chunk list -> collective -> bytes sent: with LoRA the frozen base is only gathered
    by_list: dict[str, dict[str, int]] = field(default_factory=dict)
    flags: dist.ProcessGroup | None = None  # gloo: the failure flags (see the Note)
    in_collective: bool = False  # a failure raised inside a collective is not reported
    flag_checks: int = 0
    # the backend takes a list of chunks to reduce-scatter (torch 2.6's gloo does not)
    list_reduce_scatter: bool = True

    @classmethod
    def single(cls) -> ZeroGroup:
        return cls(None, 0, 1)

    # [Note: the flag group] The failure flags travel on a gloo group (host memory, so a
    # flag never waits for the device's queue). For a subgroup (`initialize(...,
    # process_group=...)`: ZeRO inside a node, data parallel across) it is made by the
    # subgroup's members alone (`use_local_synchronization`): without it `new_group` waits
    # for every rank of the default group, and the others never call it.

    @classmethod
    def from_default(
        cls,
        group: dist.ProcessGroup | None,
        variant: str,
        device: torch.device,
        overlap: str = "auto",
        ahead: str = "auto",
    ) -> ZeroGroup:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1, device=device)
        accelerator = capabilities(device).accelerator

        def resolved(setting: str) -> bool:  # "auto": on for an accelerator
            return setting == "on" or (setting == "auto" and accelerator)

        on, early = resolved(overlap), resolved(ahead)
        rank, nproc = dist.get_rank(group), dist.get_world_size(group)
        flags = None
        if nproc > 1:
            # the flags travel on a gloo group (host memory): on the CPU the group itself
            backend = dist.get_backend(group)
            if "gloo" in str(backend) and not capabilities(device).accelerator:
                flags = group if group is not None else dist.group.WORLD
            else:
                if group is None:
                    flags = dist.new_group(backend="gloo")
                else:
                    flags = dist.new_group(
                        ranks=dist.get_process_group_ranks(group),
                        backend="gloo",
                        use_local_synchronization=True,
                    )
        return cls(group, rank, nproc, variant, on, early, device, flags=flags)

    @property
    def enabled(self) -> bool:
        return self.nproc > 1

    def members(self, chunk_index: int) -> range:
        g = chunk_index // self.nproc
        return range(g * self.nproc, (g + 1) * self.nproc)

    # -- failures (see [Note: ranks fail together]) ---------------------------------------

    def _agree(self, op: Op, can: bool = True) -> bool:
        """Right before collective `op`, its buffers already made: raise `RankFailed` if
        another rank has failed, `CollectiveMismatch` if another is about to issue a
        different collective (see [Note: ranks fail together]).

        [Note: collective order] The flag all-reduce carries the collective each rank is
        about to issue (kind, chunk list, group, size) and its negation, reduced by MAX: the
        ranks agree when every field's maximum equals its minimum. NCCL pairs collectives by
        their order alone, so ranks that reached different ones (a parameter used on one
        rank but not on the other: a data-dependent branch, an MoE expert with no tokens)
        would exchange different groups of the same size, silently, or hang. Here every
        rank sees the same reduced flags, so all raise `CollectiveMismatch` together, each
        naming what every rank was about to issue (one all-gather of the 4 codes, only
        then).

        `can`: whether this rank can issue `op` now (a gather ahead, see [Note: gathers
        ahead]); True when every rank can. A flag field the ranks reduce with the rest."""
        if self.flags is None:
            return False
        codes = op.codes()
        flag = torch.tensor([0, *codes, *(-c for c in codes), -int(can)], dtype=torch.int64)
        self.flag_checks += 1
        self._sent("failure_flag", flag, 2 * (self.nproc - 1) / self.nproc, host=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        failed = int(flag[0]) - 1
        if failed >= 0:
            raise RankFailed(f"rank {failed} failed: {self._message_from(failed, '')}")
        high, low = flag[1 : 1 + _CODES], -flag[1 + _CODES : 1 + 2 * _CODES]
        if not torch.equal(high, low):
            raise CollectiveMismatch(self._mismatch(codes))
        return int(flag[-1]) == -1

    def _mismatch(self, codes: list[int]) -> str:
        mine = torch.tensor(codes, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.nproc)]
        dist.all_gather(every, mine, group=self.flags)
        issued = ", ".join(f"rank {r}: {Op.of(t.tolist())}" for r, t in enumerate(every))
        return (
            f"the ranks reached different collectives at the same point ({issued}): under "
            "ZeRO every rank must use the same parameters in the same order in each step, "
            "as in DDP; a model whose parameter use depends on the data (a branch, or an "
            "MoE block that skips experts without tokens) is not supported, so make every "
            "rank touch every parameter (an MoE: run each expert on an empty batch) or "
            "train it without ZeRO"
        )

    def report_failure(self, error: BaseException) -> None:
        """This rank's iteration failed: tell the others at their next collective (unless
        it failed inside one, where the others fail too)."""
        if self.flags is None or self.in_collective or isinstance(error, RankFailed):
            return
        flag = torch.zeros(2 + 2 * _CODES, dtype=torch.int64)
        flag[0] = self.rank + 1  # the operation fields say nothing once a rank has failed
        self._sent("failure_flag", flag, 2 * (self.nproc - 1) / self.nproc, host=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        failed = int(flag[0]) - 1  # the highest failing rank speaks for all
        self._message_from(failed, f"{type(error).__name__}: {error}")

    def _message_from(self, failed: int, mine: str) -> str:
        data = torch.tensor(list(mine.encode()[:4000]), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(n, src=self._global(failed), group=self.flags)
        if self.rank != failed:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(data, src=self._global(failed), group=self.flags)
        return bytes(data.tolist()).decode(errors="replace")

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        self.in_collective = True
        try:
            yield
        finally:
            self.in_collective = False

    # -- the engine's collectives ------------------------------------------------------

    def all_gather(
        self,
        outputs: torch.Tensor | list[torch.Tensor],
        own: torch.Tensor,
        op: Op,
        agreed: bool = False,
    ) -> Work | None:
        """ "collective" variant: every rank's chunk, into one buffer (nproc chunks in rank
        order, `own` its slice: in place) or into a list of chunks (`own` separate). The
        caller allocates the outputs first: a failure then is told at the flag, before
        any rank enters the collective (see [Note: ranks fail together]). `agreed`: the
        flag was exchanged already (`agree_ahead`): the gather is asynchronous, and its
        work is returned to be waited on before the outputs are read."""
        if not agreed:
            self._agree(op)
        self._sent("all_gather", own, self.nproc - 1, op.chunks)
        with self._calling():
            if isinstance(outputs, list):
                return dist.all_gather(outputs, own, group=self.group, async_op=agreed)
            return _gather_into(outputs, own, self.group, async_op=agreed)

    def agree_ahead(self, op: Op, can: bool) -> bool:
        """The flag of a gather issued ahead: True if every rank can issue it now."""
        return self._agree(op, can)

    def reduce_scatter_sum(
        self, own: torch.Tensor, inputs: torch.Tensor | list[torch.Tensor], op: Op
    ) -> Work:
        """ "collective" variant, asynchronous: `own` becomes the sum over ranks of this
        rank's part of `inputs` (one buffer, `own` its slice; or a list, `own` its entry).
        Wait on the returned work before reading `own` or freeing the inputs."""
        self._agree(op)
        self._sent("reduce_scatter", own, self.nproc - 1, op.chunks)
        with self._calling():
            if isinstance(inputs, list):
                if self.list_reduce_scatter:
                    try:
                        return dist.reduce_scatter(own, inputs, group=self.group, async_op=True)
                    except RuntimeError as e:  # torch 2.6's gloo, for one
                        if "does not support reduce_scatter" not in str(e):
                            raise
                        self.list_reduce_scatter = False
                # through one flat buffer, waited for here: the buffer lives only as long
                # as this call (gloo copies through such a buffer itself where it can)
                work = _reduce_scatter_into(own, torch.cat(inputs), self.group, async_op=True)
                work.wait()
                return work
            return _reduce_scatter_into(own, inputs, self.group, async_op=True)

    def broadcast_each(self, outputs: list[torch.Tensor], op: Op) -> None:
        """ "serial" variant of the gather: outputs[r] receives rank r's chunk."""
        self._agree(op)
        for r, out in enumerate(outputs):
            self._broadcast(out, r, op.chunks)

    def reduce_each_mean(self, inputs: list[torch.Tensor], out: torch.Tensor, op: Op) -> None:
        """ "serial" variant: out = mean over ranks of inputs[self.rank] (inputs[r] is the
        group's chunk r), by one reduction to each owner."""
        self._agree(op)
        for r, t in enumerate(inputs):
            if r != self.rank:
                self._sent("reduce", t, 1, op.chunks)  # this rank's part goes to owner r
            with self._calling():
                dist.reduce(t, dst=self._global(r), op=dist.ReduceOp.SUM, group=self.group)
        out.copy_(inputs[self.rank])
        out.div_(self.nproc)

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL: not CPU
        self._agree(Op("all_reduce", numel=1))
        self._all_reduce(t)
        return float(t.item())

    def all_reduce_max(self, value: int) -> int:
        """The largest `value` over the ranks (ranks agreeing on a choice)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._agree(Op("all_reduce", numel=1))
        self._sent("all_reduce", t, 2 * (self.nproc - 1) / self.nproc)
        with self._calling():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self._agree(Op("broadcast", numel=t.numel()))
        self._broadcast(t, src)

    def all_reduce_mean_(self, t: torch.Tensor) -> None:
        self._agree(Op("all_reduce", numel=t.numel()))
        self._all_reduce(t)
        t.div_(self.nproc)

    def barrier(self) -> None:
        self._agree(Op("barrier"))
        with self._calling():
            dist.barrier(group=self.group)

    def warm_up(self, numel: int, dtype: torch.dtype) -> None:
        """[Note: communicator buffers before the budget] NCCL (2.22 on) connects each
        algorithm at its first use and allocates its buffers then, outside the caching
        allocator; on NVSwitch machines the NVLS multicast memory too. The device budget is
        read from the free memory once (`plannable_bytes`), so those buffers must exist by
        then, or they come out of the room the budget promised the chunks. One in-place
        all-gather and reduce-scatter of a group's size, in the chunks' dtype, before the
        budget is read; the group buffer goes back to the caching allocator, which the
        budget counts as available. Only on an accelerator with the single-buffer
        collectives (gloo and the serial variant allocate nothing that outlives a call)."""
        if not (
            self.enabled and self.variant == "collective" and capabilities(self.device).accelerator
        ):
            return
        buffer = torch.zeros(numel * self.nproc, dtype=dtype, device=self.device)
        own = buffer.chunk(self.nproc)[self.rank]
        self.all_gather(buffer, own, Op("all_gather", numel=numel))
        self.reduce_scatter_sum(own, buffer, Op("reduce_scatter", numel=numel)).wait()

    # -- counted wrappers -------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor, src: int, kind: str = "") -> None:
        if src == self.rank:
            self._sent("broadcast", t, self.nproc - 1, kind)
        with self._calling():
            dist.broadcast(t, src=self._global(src), group=self.group)

    def _all_reduce(self, t: torch.Tensor) -> None:
        self._sent("all_reduce", t, 2 * (self.nproc - 1) / self.nproc)
        with self._calling():
            dist.all_reduce(t, group=self.group)

    def _sent(
        self, name: str, t: torch.Tensor, times: float, kind: str = "", host: bool = False
    ) -> None:
        check(
            host or t.device == self.device,
            f"{name} handed a tensor on {t.device}; collectives take the compute device's "
            f"({self.device})",
        )
        n = int(t.numel() * t.element_size() * times)
        self.bytes_sent += n
        entry = self.calls.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += n
        if kind:
            per = self.by_list.setdefault(kind, {})
            per[name] = per.get(name, 0) + n

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank


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
        remote = [m for m in members if m is not own]
        r = self.residency
        r.make_resident([own], TierName.DEVICE)
        check(
            own.tier == TierName.DEVICE,
            f"{_name(own)} goes into an all-gather from the {own.tier} tier",
        )
        r.reserve(TierName.DEVICE, sum(m.nbytes for m in remote), {id(m) for m in members})
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
        A group with gradients to stash first, or with its reduction in flight, is left
        to its use. Called with `zero.ahead` on (the manager asks). True if the gather
        was issued."""
        key = self._key(c)
        if self.zero.variant != "collective" or key in self.live:
            return False
        members = self._members(c)
        if any(s.state is TensorState.HOLD_AFTER_BWD for m in members for s in m.slots):
            return False
        if any(self._key(f.own) == key for f in self.in_flight):
            return False
        own = members[self.zero.rank]
        r = self.residency
        need = sum(m.nbytes for m in members if m is not own)
        need += own.nbytes if self.contiguous else 0  # its copy into the group's buffer
        device = r.tiers[TierName.DEVICE]
        can = (
            own.tier == TierName.DEVICE
            and device.used_bytes + r.transfers.sending_bytes + need <= r.allowed(TierName.DEVICE)
        )
        op = Op("all_gather", own.kind.value, key[1], own.capacity)
        got: list[torch.Tensor] = []
        with r.tracer.chunk_memory():
            if can:
                r.transfers.arrive(own)  # a copy in may still be writing it
                got = self._allocate(members, own)
            if not self.zero.agree_ahead(op, can):
                for t in got:
                    device.release(t)
                return False
            with profiled("pstar::all_gather ahead"):
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

    def _drop(self, members: list[Chunk], own: Chunk, pressed: bool = False) -> None:
        """The group leaves: remote chunks are forgotten, the own chunk keeps its bytes
        in a buffer of its own (`pressed`: on the host, see [Note: leaving the group
        buffer])."""
        for m in members:
            m.pins -= 1
        if self._buffers.pop(id(own), None) is not None:
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
        self._drop(members, own, pressed)

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
