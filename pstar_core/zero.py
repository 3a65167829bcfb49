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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pstar_core.chunk import ChunkType
from pstar_core.devices import capabilities, check

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
    flag_s: float = 0.0  # wall time in the flag all-reduces (waiting for the slowest rank)
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
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        self.flag_s += time.perf_counter() - t0
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
