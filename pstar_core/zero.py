"""Chunk-based ZeRO data parallelism: communication groups and their collectives.

The chunk lists are cut at the same positions on every rank; chunk i is owned by rank
`i % nproc`, and a communication group is the nproc consecutive chunks
`[g * nproc, (g + 1) * nproc)`, one owned by each rank. A rank keeps only its own chunks
of all four lists, so its model data is 1/nproc of the model's.

Two variants move the same bytes:
- "collective": one all-gather of the group's param chunks before use, one
  reduce-scatter (sum, then divided by nproc) of their gradients after backward;
- "serial": the paper's memory-saving variant, nproc broadcasts (each owner sends its
  chunk) and nproc reductions to each owner, so the only buffer is the chunk itself.

Both need identical call order on every rank, which holds because every rank runs the
same model and so reaches the same access and release points (as in DDP, a parameter
used on one rank but not on another in the same step is not supported).
NCCL on GPU, gloo on CPU: the backend is the process group's. Only gloo runs here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ZeroGroup:
    """The process group and this rank's place in it."""

    group: dist.ProcessGroup | None
    rank: int
    nproc: int
    variant: str = "collective"  # or "serial"
    bytes_sent: int = 0  # bytes this rank put on the wire, counted per collective

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

    def owner(self, chunk_index: int) -> int:
        return chunk_index % self.nproc

    def members(self, chunk_index: int) -> range:
        g = chunk_index // self.nproc
        return range(g * self.nproc, (g + 1) * self.nproc)

    def gather(self, own: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """outputs[r] receives rank r's chunk; outputs[self.rank] is `own` itself."""
        n = own.numel() * own.element_size()
        if self.variant == "serial":
            for r, out in enumerate(outputs):
                dist.broadcast(out, src=self._global(r), group=self.group)
            self.bytes_sent += n * (self.nproc - 1)
        else:
            dist.all_gather(outputs, own, group=self.group)
            self.bytes_sent += n * (self.nproc - 1)

    def reduce_scatter_mean(self, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
        """out = mean over ranks of inputs[self.rank] (inputs[r] is the group's chunk r)."""
        n = out.numel() * out.element_size()
        if self.variant == "serial":
            for r, t in enumerate(inputs):
                dist.reduce(t, dst=self._global(r), op=dist.ReduceOp.SUM, group=self.group)
            out.copy_(inputs[self.rank])
        else:
            dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM, group=self.group)
        out.div_(self.nproc)
        self.bytes_sent += n * (self.nproc - 1)

    def all_reduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t.item())

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        dist.broadcast(t, src=self._global(src), group=self.group)

    def all_reduce_mean_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)
        t.div_(self.nproc)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group else group_rank
