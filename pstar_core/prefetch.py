"""Prefetch: the chunks the next operators use start moving before they are asked for.

[Note: prefetch] While an iteration follows the trace, the chunks each coming moment uses,
and the tier it reads them on (the device for an operator, Adam's tier for an Adam
moment), are known: the trace's use lists, the same ones OPT reads. When a moment
begins, the chunks the next `prefetch_moments` moments use, and further on until
`prefetch_chunks` chunks are found that sit elsewhere, are sent on their way:
- spilled to disk: read back into host memory by a reader thread (`DiskReader`): on a
  machine without a GPU this is the move that costs, and it overlaps compute this way;
- in host memory and read on a device with streams: copied on a copy stream
  (`devices.CopyStream`), so the copy overlaps the compute stream's kernels; only into
  room that stays free until the chunk's use (the least A_j up to it);
- on the device and read on the host (Adam on the host): copied out on the other copy
  stream, so the next chunks' gradients leave while Adam runs on this one; and once Adam
  updated a chunk on the host, its parameters go back the same way, into free room.
When the first chunk due on the device finds no room, the chunks whose next use comes
after its use are sent to the host ahead, farthest first (OPT's order), on the copy
stream (`prefetch_evicts`): their room is free once those copies are done (`reap_sends`
asks without waiting), and the chunk moves in at a later moment's prefetch. A send holds
its device memory until its copy is done, so `reserve` waits for the sends under way
before it counts on that room.
A chunk on its way is accounted on its new tier at once (budgets hold from the start)
and `arrive` waits for it before anything reads its payload; every path that reads a
payload goes through `Residency.make_resident`, `in_memory` or `move`, which call it.
Disk reads only fill free host room (evicting to make room there was measured to move
more bytes and run slower). Waiting, not prefetching, is what changes the timing, so
results are bitwise those without it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from pstar_core.tiers import SpillFile, TierName


class Arrival(NamedTuple):
    """A move issued and not yet waited on."""

    src: TierName  # the tier it comes from (disk, host or device)
    done: Future | object  # a Future (disk read) or a copy stream's event
    disk_offset: int | None = None  # the spill region to give back once read
    source: torch.Tensor | None = None  # the host buffer a copy in reads (kept until done)
    nbytes: int = 0  # the chunk's bytes (a copy out holds them on the device until done)


class DiskReader:
    """One background thread reading spilled chunks back into host memory.

    `os.preadv` releases the GIL, so the read proceeds while the main thread computes.
    The spill file's region list is only touched by the main thread (`free` after the
    read is waited on), so the reader needs no lock.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, spill: SpillFile, offset: int, out: torch.Tensor) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pstar-disk-read")
        return self._pool.submit(spill.read, offset, out)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
