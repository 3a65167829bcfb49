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


@dataclass
class ZeroGroup:
    """The process group and this rank's place in it."""

    group: dist.ProcessGroup | None
    rank: int
    nproc: int
    variant: str = "collective"  # or "serial"
    bytes_sent: int = 0  # see [Note: bytes sent]
    calls: dict[str, list[int]] = field(default_factory=dict)  # collective -> [calls, bytes]

    @classmethod
    def single(cls) -> ZeroGroup:
        return cls(None, 0, 1)

    @classmethod
    def from_default(cls, group: dist.ProcessGroup | None, variant: str) -> ZeroGroup:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            return cls.single()
        return cls(group, dist.get_rank(group), dist.get_world_size(group), variant)

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

    def all_reduce_sum(self, value: float, device: torch.device | None = None) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
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
        n = int(t.numel() * t.element_size() * times)
        self.bytes_sent += n
        entry = self.calls.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += n

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank
