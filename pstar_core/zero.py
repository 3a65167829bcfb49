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
import logging
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pstar_core.chunk import ChunkType
from pstar_core.devices import capabilities, check

Work = dist.Work
log = logging.getLogger(__name__)


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


_OP_KINDS = (
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_reduce",
    "barrier",
    "point",  # an agreement point of sections (see [Note: agreed sections])
)
_SECTIONS = ("forward", "backward")
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
        if self.kind == "point":
            what = _SECTIONS[self.group] if 0 <= self.group < len(_SECTIONS) else "the end"
            return f"the agreement point at {what} of micro-batch {self.numel}"
        where = f" of {self.chunks} group {self.group}" if self.chunks else ""
        return f"{self.kind}{where} ({self.numel} elements)"


_CODES = len(Op("barrier").codes())
# a flag: [failing rank + 1, its failure a departure, codes, -codes, -can, digest, -digest]
_CAN = 2 + 2 * _CODES
_FLAG = _CAN + 3
_PLAYABLE = ("all_gather", "reduce_scatter", "broadcast", "reduce")
_MAX_SCRIPTS = 64  # sections of different micro-batch positions, each with its own


class Entry(NamedTuple):
    """A collective of a section, as the ranks agreed on it (see [Note: agreed sections])."""

    op: Op
    dtype: torch.dtype | None = None
    ahead: bool = False  # the question whether to gather a group ahead of its use
    declined: bool = False  # ... and the ranks' answer was no (no collective)


def _digest(script: list[Entry]) -> int:
    """A 31-bit digest of a script: ranks following different ones must not go fast."""
    return (
        zlib.crc32(
            repr([(e.op.codes(), str(e.dtype), e.ahead, e.declined) for e in script]).encode()
        )
        >> 1
    )


_SAME_PARAMS = (
    "under ZeRO every rank must use the same parameters in the same order in each step, "
    "as in DDP; a model whose parameter use depends on the data (a branch, or an "
    "MoE block that skips experts without tokens) is not supported, so make every "
    "rank touch every parameter (an MoE: run each expert on an empty batch) or "
    "train it without ZeRO"
)


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
    # [Note: agreed sections]: one flag per section (False: one per collective)
    per_section: bool = True
    scripts: dict[tuple[str, int], list[Entry]] = field(default_factory=dict)
    steady: set[tuple[str, int]] = field(default_factory=set)  # recorded the same twice
    section: tuple[str, int] | None = None  # the section under way
    recording: list[Entry] | None = None  # its collectives, to agree on once it is over
    script: list[Entry] | None = None  # the agreed collectives it follows (no flags)
    at: int = 0  # the next of them
    counts: dict[str, int] = field(default_factory=dict)  # sections of a kind in the step
    owed: str | None = None  # this rank left its section's script: not yet told
    agreed_sections: int = 0  # sections run on an agreed script

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
        per_section: bool = True,
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
        return cls(
            group, rank, nproc, variant, on, early, device, flags=flags, per_section=per_section
        )

    @property
    def enabled(self) -> bool:
        return self.nproc > 1

    def members(self, chunk_index: int) -> range:
        g = chunk_index // self.nproc
        return range(g * self.nproc, (g + 1) * self.nproc)

    # -- failures (see [Note: ranks fail together]) ---------------------------------------

    def _agree(
        self, op: Op, can: bool = True, dtype: torch.dtype | None = None, ahead: bool = False
    ) -> bool:
        """Right before collective `op`, its buffers already made: raise `RankFailed` if
        another rank has failed, `CollectiveMismatch` if another is about to issue a
        different collective (see [Note: ranks fail together]). In a section that follows
        an agreed script, a check against the script instead, with no exchange (see
        [Note: agreed sections]).

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
        entry = Entry(op, dtype, ahead)
        if self.script is not None:
            return self._follow(entry)
        flag = self._exchange(op.codes(), can)
        agreed = int(flag[_CAN]) == -1
        if self.recording is not None:
            self.recording.append(entry._replace(declined=ahead and not agreed))
        return agreed

    def _exchange(self, codes: list[int], can: bool, digest: int = 0) -> torch.Tensor:
        """One flag all-reduce (MAX); raise if a rank has failed (every rank then gives up
        the iteration, and the sections are agreed on again from the next one), or if the
        ranks are about to issue different collectives (`codes`)."""
        negated = [-c for c in codes]
        flag = torch.tensor([0, 0, *codes, *negated, -int(can), digest, -digest], dtype=torch.int64)
        self.flag_checks += 1
        self._sent("failure_flag", flag, 2 * (self.nproc - 1) / self.nproc, host=True)
        t0 = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        self.flag_s += time.perf_counter() - t0
        failed = int(flag[0]) - 1
        if failed >= 0:
            self._reset(departed=bool(flag[1]))
            message = self._message_from(failed, "")
            if int(flag[1]):  # it left the agreed collectives: the message says how
                raise CollectiveMismatch(message)
            raise RankFailed(f"rank {failed} failed: {message}")
        if not torch.equal(flag[2 : 2 + _CODES], -flag[2 + _CODES : _CAN]):
            raise CollectiveMismatch(self._mismatch(codes))
        return flag

    def _mismatch(self, codes: list[int]) -> str:
        mine = torch.tensor(codes, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.nproc)]
        dist.all_gather(every, mine, group=self.flags)
        issued = ", ".join(f"rank {r}: {Op.of(t.tolist())}" for r, t in enumerate(every))
        self._reset(departed=True)  # every rank raises: none keeps what it recorded
        return f"the ranks reached different collectives at the same point ({issued}): " + (
            _SAME_PARAMS
        )

    def report_failure(self, error: BaseException) -> None:
        """This rank's iteration failed: tell the others at their next flag exchange
        (unless it failed inside a collective, where the others fail too). In a section
        that follows an agreed script, the others go on without flags to the section's
        end: this rank first issues the script's remaining collectives with stand-in
        buffers (see [Note: agreed sections])."""
        if self.flags is None or self.in_collective:
            return
        if isinstance(error, RankFailed) and self.owed is None:
            return  # every rank raised it: the others know
        departed, self.owed = self.owed, None
        self._play_rest()
        flag = torch.zeros(_FLAG, dtype=torch.int64)
        flag[0] = self.rank + 1  # the operation fields say nothing once a rank has failed
        flag[1] = int(departed is not None)
        self._sent("failure_flag", flag, 2 * (self.nproc - 1) / self.nproc, host=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        failed = int(flag[0]) - 1  # the highest failing rank speaks for all
        self._message_from(failed, departed or f"{type(error).__name__}: {error}")
        self._reset(departed=bool(flag[1]))

    # -- agreed sections ------------------------------------------------------------------

    # [Note: agreed sections] A flag exchange before every collective holds every rank's
    # host at every collective, as a barrier would, and costs a round trip each (on 8 GPUs
    # with 3 collectives per group per micro-batch, hundreds a step). But a training forward
    # or backward that follows the trace issues the same collectives in the same order in
    # every iteration. So the engine marks agreement points: a training forward's start, a
    # backward's start and its end (`point`). Between two of them runs a section, named by
    # its kind and its micro-batch in the step. While a section runs on the trace without a
    # script, every collective in it has its flag, as before, and each rank records the
    # sequence (the script: each collective, and each question whether to gather a group
    # ahead with the ranks' answer), kept once the section's end point is passed, so every
    # rank keeps the same one. When two runs recorded the same script (the first run's
    # gathers ahead can differ from the steady ones), each later run of the section is
    # agreed at its start point, in one flag exchange: every rank has a script for it, and
    # the same one (a digest). Then its collectives go with no exchange at all: each is
    # checked against the script locally, and a gather ahead is issued where the script says
    # so; a rank without room for it makes room, as a gather at use does. A rank that fails
    # in such a section, or leaves the script (`CollectiveMismatch` raised on that rank
    # alone), cannot just stop: the others go on issuing the script's collectives. It gives
    # up its iteration, then issues the rest of the script with stand-in buffers of the
    # agreed sizes (zeros; its groups' buffers are freed by then), and joins the others'
    # next flag exchange (the section's end point at the latest) with its failure. Every
    # rank then raises there, as before: `RankFailed`, or `CollectiveMismatch` for a
    # departure. What the others computed between the failure and that point is given up
    # with the iteration (and after a departure every rank forgets its scripts: the next
    # runs agree anew), but Adam beside backward may have updated chunks from it (the engine
    # then refuses to go on until a checkpoint is loaded, as for a failure in backward
    # today). A rank that cannot issue a stand-in (its process gone, a lost peer) leaves the
    # others waiting, as a lost peer does. `zero.agree_per_collective: true` turns sections
    # off.

    def point(self, kind: str | None, following: bool) -> None:
        """An agreement point: the section under way ends, and a section of `kind`
        ("forward", "backward"; None: none) begins, on the script agreed for it if every
        rank has the same one and the iteration `following` the trace."""
        if self.flags is None or not self.per_section:
            return
        if self.script is not None and self.at < len(self.script):
            self.owed = self._departure(f"ended after {self.at} of", self.script[self.at])
            message = self.owed
            self.report_failure(CollectiveMismatch(message))
            raise CollectiveMismatch(message)
        done, recorded = self.section, self.recording
        self._leave_section()
        key = None
        if kind is not None:
            n = self.counts.get(kind, 0)
            self.counts[kind] = n + 1
            key = (kind, n)
        script = self.scripts.get(key) if key in self.steady and following else None
        digest = _digest(script) if script is not None else 0
        here = Op("point", group=_SECTIONS.index(kind) if kind else -1, numel=key[1] if key else 0)
        flag = self._exchange(here.codes(), script is not None, digest)
        if (
            done is not None
            and recorded is not None
            and all(e.op.kind in _PLAYABLE for e in recorded)
            and (done in self.scripts or len(self.scripts) < _MAX_SCRIPTS)
        ):
            if self.scripts.get(done) == recorded:
                self.steady.add(done)
            else:
                self.scripts[done] = recorded
                self.steady.discard(done)
        if key is None or not following:
            return
        self.section = key
        if int(flag[_CAN]) == -1 and int(flag[_CAN + 1]) == -int(flag[_CAN + 2]):
            self.script = script
            self.agreed_sections += 1
        else:
            self.recording = []

    def end_step(self) -> None:
        """The step is over: the next forward is micro-batch 0 again."""
        self.counts.clear()

    def _reset(self, departed: bool) -> None:
        """A failed iteration: every rank is between sections; after a departure each
        drops its scripts too, and the ranks agree on them anew."""
        if departed:
            self.scripts.clear()
            self.steady.clear()
        self.counts.clear()
        self._leave_section()

    def _leave_section(self) -> None:
        self.section, self.recording, self.script, self.at = None, None, None, 0

    def _follow(self, entry: Entry) -> bool:
        assert self.script is not None
        expected = self.script[self.at] if self.at < len(self.script) else None
        if expected is None or expected._replace(declined=False) != entry:
            self.owed = self._departure(
                f"was about to issue {entry.op} after {self.at} of", expected
            )
            raise CollectiveMismatch(self.owed)
        self.at += 1
        return not expected.declined

    def _departure(self, what: str, expected: Entry | None) -> str:
        agreed = f"{expected.op} next" if expected is not None else "nothing more"
        kind, n = self.section or ("", 0)
        return (
            f"rank {self.rank} left the collectives the ranks agreed on for the {kind} of "
            f"micro-batch {n}: it {what} the agreed collectives, which have {agreed}; "
            + _SAME_PARAMS
        )

    def _play_rest(self) -> None:
        """The rest of the script, with stand-in buffers (see [Note: agreed sections])."""
        rest = [e for e in (self.script or [])[self.at :] if not e.declined]
        self.script = None
        if rest:
            log.warning(
                "rank %d gives up its iteration: %d collectives of the agreed sequence are "
                "issued with stand-in buffers so the other ranks reach the next flag",
                self.rank,
                len(rest),
            )
        for e in rest:
            self._stand_in(e)

    def _stand_in(self, e: Entry) -> None:
        """The collective of `e`, in the form the other ranks issue it, on zeros."""
        n, dtype, device = e.op.numel, e.dtype, self.device
        contiguous = self.variant == "collective" and capabilities(device).accelerator

        def zeros(k: int = n) -> torch.Tensor:
            return torch.zeros(k, dtype=dtype, device=device)

        if e.op.kind in ("all_gather", "reduce_scatter"):
            # one buffer (its slice this rank's) or a list (its entry), as `GatheredGroups`
            whole: torch.Tensor | list[torch.Tensor]
            if contiguous:
                whole = zeros(n * self.nproc)
                own = whole.chunk(self.nproc)[self.rank]
            else:
                whole = [zeros() for _ in range(self.nproc)]
                own = whole[self.rank]
            if e.op.kind == "all_gather":
                self._all_gather(whole, own, "", async_op=False)
            else:
                self._reduce_scatter(own, whole, "").wait()
            return
        for r in range(self.nproc):
            if e.op.kind == "broadcast":
                self._broadcast(zeros(), r)
            else:
                with self._calling():
                    dist.reduce(zeros(), dst=self._global(r), group=self.group)

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
            self._agree(op, dtype=own.dtype)
        return self._all_gather(outputs, own, op.chunks, async_op=agreed)

    def _all_gather(
        self,
        outputs: torch.Tensor | list[torch.Tensor],
        own: torch.Tensor,
        kind: str,
        async_op: bool,
    ) -> Work | None:
        self._sent("all_gather", own, self.nproc - 1, kind)
        with self._calling():
            if isinstance(outputs, list):
                return dist.all_gather(outputs, own, group=self.group, async_op=async_op)
            return _gather_into(outputs, own, self.group, async_op=async_op)

    def agree_ahead(self, op: Op, can: bool, dtype: torch.dtype) -> bool:
        """The flag of a gather issued ahead: True if every rank can issue it now. In a
        section on an agreed script: True if the script gathers it here, whether this rank
        `can` or not (it then makes room first; see [Note: agreed sections])."""
        return self._agree(op, can, dtype, ahead=True)

    def reduce_scatter_sum(
        self, own: torch.Tensor, inputs: torch.Tensor | list[torch.Tensor], op: Op
    ) -> Work:
        """ "collective" variant, asynchronous: `own` becomes the sum over ranks of this
        rank's part of `inputs` (one buffer, `own` its slice; or a list, `own` its entry).
        Wait on the returned work before reading `own` or freeing the inputs."""
        self._agree(op, dtype=own.dtype)
        return self._reduce_scatter(own, inputs, op.chunks)

    def _reduce_scatter(
        self, own: torch.Tensor, inputs: torch.Tensor | list[torch.Tensor], kind: str
    ) -> Work:
        self._sent("reduce_scatter", own, self.nproc - 1, kind)
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
        self._agree(op, dtype=outputs[0].dtype)
        for r, out in enumerate(outputs):
            self._broadcast(out, r, op.chunks)

    def reduce_each_mean(self, inputs: list[torch.Tensor], out: torch.Tensor, op: Op) -> None:
        """ "serial" variant: out = mean over ranks of inputs[self.rank] (inputs[r] is the
        group's chunk r), by one reduction to each owner."""
        self._agree(op, dtype=out.dtype)
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
