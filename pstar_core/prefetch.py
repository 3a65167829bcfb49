"""Prefetch: the chunks the next operators use start moving before they are asked for.

[Note: prefetch] While an iteration follows the trace, the chunks used at the next
`depth` moments are known (the trace's use lists, the same ones OPT reads). When a moment
begins, those that sit a tier too far are sent on their way in the background:
- spilled to disk: read back into host memory by a reader thread (`DiskReader`): on a
  machine without a GPU this is the move that costs, and it overlaps compute this way;
- in host memory, for a CUDA device: copied on a dedicated copy stream
  (`devices.CopyStream`), so the copy overlaps the compute stream's kernels.
A chunk on its way is accounted on its new tier at once (budgets hold from the start)
and `arrive` waits for it before anything reads its payload; every path that reads a
payload goes through `Residency.make_resident`, `in_memory` or `move`, which call it.
A prefetch only fills free room: it never evicts (evicting chunks needed later to make
room was measured to move more bytes and run slower); a chunk that does not fit is left
for the ordinary move at its use, where OPT makes the room. Waiting, not
prefetching, is what changes the timing, so results are bitwise those without it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from pstar_core.tiers import SpillFile, TierName


class Arrival(NamedTuple):
    """A move issued and not yet waited on."""

    src: TierName  # the tier it comes from (disk or host)
    done: Future | object  # a Future (disk read) or the copy stream's event (CUDA)
    disk_offset: int | None  # the spill region to give back once read
    source: torch.Tensor | None  # the host buffer a device copy reads (kept until done)


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
