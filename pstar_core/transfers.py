"""`Transfers`: the copies that move a chunk's payload between tiers, and their counters.

A transfer is one hop, disk <-> host or host <-> device, into room the caller has made
(`Residency` decides what moves and where, and makes the room); here the bytes are
copied, the tiers' accounts and the move counters updated, and the payload index kept
true. Moves issued ahead of their use (see [Note: prefetch] in prefetch.py) are arrivals:
accounted on their new tier at once, waited for (`arrive`) before anything reads them.

[Note: clean chunks] A chunk copied host -> device keeps its host buffer (`host_copy`,
counted on the host tier) while the host budget has room. As long as the device only
reads the chunk (a forward operator's parameters, a frozen chunk anywhere: `Residency.
make_resident(reading=...)`), the two hold the same bytes, and evicting it copies
nothing back: the host buffer becomes its payload again. Any other use may write it (a
gradient, Adam on the device, a collective, a load): the host copy is dropped first. The
host drops its copies before it spills a chunk to disk for room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from pstar_core.chunk import Chunk, ChunkType
from pstar_core.devices import CopyStream
from pstar_core.prefetch import Arrival, DiskReader
from pstar_core.tiers import DEVICE, DISK, HOST, Tier, TierName
from pstar_core.tracer import MemoryTracer, profiled


class PayloadIndex:
    """Storage address -> the chunks whose payload lies in it (one each, except a gathered
    ZeRO group: its chunks are slices of one buffer). The saved-tensor hooks ask it which
    chunk an activation autograd kept is a view of."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[Chunk]] = {}

    def add(self, c: Chunk) -> None:
        self._by_storage.setdefault(c.payload.untyped_storage().data_ptr(), []).append(c)

    def remove(self, c: Chunk) -> None:
        ptr = c.payload.untyped_storage().data_ptr()
        chunks = self._by_storage.get(ptr, [])
        if c in chunks:
            chunks.remove(c)
        if not chunks:
            self._by_storage.pop(ptr, None)

    def items(self) -> Iterable[tuple[int, list[Chunk]]]:
        return self._by_storage.items()

    def chunk_of_tensor(self, t: torch.Tensor) -> Chunk | None:
        """The chunk whose current payload holds `t` (a view of it), or None. A freed
        chunk's old address may be reused by any tensor, so entries are checked against
        the payloads they name."""
        ptr, start = t.untyped_storage().data_ptr(), t.storage_offset()
        for c in self._by_storage.get(ptr, ()):
            p = c.payload
            if (
                p is not None
                and p.dtype == t.dtype
                and p.untyped_storage().data_ptr() == ptr
                and p.storage_offset() <= start < p.storage_offset() + c.capacity
            ):
                return c
        return None


class Transfers:
    def __init__(
        self,
        tiers: dict[TierName, Tier],
        tracer: MemoryTracer,
        payloads: PayloadIndex,
        device: torch.device,
        lists: dict[ChunkType, list[Chunk]],
        keep_host_copies: bool = True,
    ) -> None:
        self.tiers = tiers
        self.keep_host_copies = keep_host_copies
        self.tracer = tracer
        self.payloads = payloads
        self.bytes_moved: dict[str, int] = {}  # direction -> bytes, in total
        self.moves: dict[str, int] = {}
        self.iteration_bytes_moved: dict[str, int] = {}  # in the iteration under way
        self.iteration_moves: dict[str, int] = {}
        self.last_iteration_bytes_moved: dict[str, int] = {}  # in the last complete one
        self.last_iteration_moves: dict[str, int] = {}
        self.prefetched: dict[str, int] = {}  # direction -> chunks prefetched in total
        self.arriving: dict[int, Arrival] = {}  # moves under way, by chunk id
        self._reader = DiskReader()
        self._copier = CopyStream(device)
        self._lists = lists  # the chunks, for their host copies
        self.host_copy_bytes = 0  # host copies of clean device chunks ([Note: clean chunks])
        self.clean_evictions = 0  # evictions that copied nothing, in total
        # [Note: arrivals without a host wait] A copy in is waited for by the compute
        # stream only; its pinned source may still be read by the copy engine after. So
        # the source's copy event is kept (by the buffer's address) while it is a host
        # copy, and a source given back while its copy may run is held until the event
        # says it is done (`_release_source`); the host waits only before it writes one
        self._reading: dict[int, Any] = {}
        self._held: list[tuple[torch.Tensor, Any]] = []

    @property
    def prefetch_possible(self) -> bool:
        """Whether anything is ever far away: a disk tier in use, or a copy stream (a
        device with streams) to move host chunks beside compute."""
        return self.tiers[DISK].spill is not None or self._copier.enabled

    def hop(self, c: Chunk, dst: TierName) -> None:
        """Copy `c` one tier over (disk <-> host <-> device) into room already made there;
        its old payload or spill region is given back (a device chunk with a current host
        copy goes back to it without a copy: [Note: clean chunks])."""
        self.arrive(c)
        src = c.tier
        if src == DEVICE and dst == HOST and c.host_copy is not None:
            self._back_to_host_copy(c)
            return
        assert {src, dst} != {DISK, DEVICE}, "disk <-> device goes through the host"
        tier = self.tiers[dst]
        with self.tracer.chunk_memory(), profiled(f"pstar::move {src}->{dst}"):
            if dst == DISK:
                c.disk_offset = tier.spill_file().write(c.payload)
                self.payloads.remove(c)
                self.tiers[src].release(c.payload)
                c.payload = None
            else:
                new = tier.allocate(c.capacity, c.dtype)
                if src == DISK:
                    spill = self.tiers[DISK].spill_file()
                    spill.read(c.disk_offset, new)
                    spill.free(c.disk_offset, c.nbytes)
                    c.disk_offset = None
                else:
                    new.copy_(c.payload)
                    self.payloads.remove(c)
                    if src == HOST and dst == DEVICE:
                        kept = c.payload
                    else:
                        self.tiers[src].release(c.payload)
                c.payload = new
                self.payloads.add(c)
        self.account(c, src, dst)
        if src == HOST and dst == DEVICE:
            self._keep_host_copy(c, kept)

    def account(self, c: Chunk, src: TierName, dst: TierName) -> None:
        """A move of `c` from tier `src` to `dst`: the tiers' bytes and the move counters."""
        self.tiers[src].remove(c.nbytes)
        self.tiers[dst].add(c.nbytes)
        c.tier = dst
        key = f"{src}->{dst}"
        for counter, n in (
            (self.bytes_moved, c.nbytes),
            (self.moves, 1),
            (self.iteration_bytes_moved, c.nbytes),
            (self.iteration_moves, 1),
        ):
            counter[key] = counter.get(key, 0) + n

    def end_iteration(self) -> None:
        """Close the per-iteration move counters (called at the end of `step()`)."""
        self.last_iteration_bytes_moved = self.iteration_bytes_moved
        self.last_iteration_moves = self.iteration_moves
        self.iteration_bytes_moved, self.iteration_moves = {}, {}

    # -- arrivals (see [Note: prefetch] in prefetch.py) --------------------------------

    def arrive(self, c: Chunk) -> None:
        """Wait until a prefetched chunk's payload holds its bytes (no-op otherwise)."""
        a = self.arriving.pop(id(c), None)
        if a is None:
            return
        with profiled("pstar::wait prefetch"):
            if a.src == DISK:
                a.done.result()
                self.tiers[DISK].spill_file().free(a.disk_offset, c.nbytes)
            elif a.source is not None:  # a copy in: its pinned source is its host copy
                self._copier.wait(a.done, host=False)
                self._reading[a.source.data_ptr()] = a.done
                self._keep_host_copy(c, a.source)
            else:  # a copy out: the host reads its bytes
                self._copier.wait(a.done)
        self._release_held()

    @property
    def sending_bytes(self) -> int:
        """Device bytes of chunks on their way to the host: accounted there, and still
        held on the device until their copy is done."""
        return sum(a.nbytes for a in self.arriving.values() if a.src == DEVICE)

    def copies_in_flight(self, src: TierName) -> int:
        """Copies from tier `src` issued on a copy stream and not done yet."""
        return sum(1 for a in self.arriving.values() if a.src == src and not a.done.query())

    def landed_on_host(self, c: Chunk) -> bool:
        """Whether `c` is on the host with its bytes there: no move under way, or a copy
        out that is done (then waited for, which costs no stall)."""
        if c.tier != HOST:
            return False
        a = self.arriving.get(id(c))
        if a is None:
            return True
        if a.src != DEVICE or not a.done.query():
            return False
        self.arrive(c)
        return True

    def reap_sends(self) -> None:
        """Forget the copies out to the host that are done (their device room is free)."""
        for key in [k for k, a in self.arriving.items() if a.src == DEVICE and a.done.query()]:
            del self.arriving[key]

    def settle_sends(self) -> None:
        """Wait for every copy out to the host (their device memory is needed now)."""
        for key in [k for k, a in self.arriving.items() if a.src == DEVICE]:
            a = self.arriving.pop(key)
            with profiled("pstar::wait send"):
                self._copier.wait(a.done)

    def ahead(
        self, c: Chunk, tier: TierName, device_allowed: int, movable: Callable[[Chunk], bool]
    ) -> None:
        """Start moving `c`, which a coming moment reads on `tier`, toward it: from disk
        into free host room; from host into free device room within `device_allowed`;
        from the device to free host room (a chunk whose Adam runs on the host, while
        Adam runs on the chunk before) if `movable`. Never evicts: a chunk that does not
        fit moves at its use, where OPT makes the room."""
        if id(c) in self.arriving or c.pins or c.tier == tier:
            return
        if c.tier == DISK and self.tiers[DISK].spill is not None:
            self._from_disk(c)
        elif c.tier == HOST and tier == DEVICE and self._copier.enabled:
            self._to_device(c, device_allowed)
        elif c.tier == DEVICE and tier == HOST and movable(c):
            self.send(c)  # (a chunk with a current host copy goes back to it)

    def _from_disk(self, c: Chunk) -> None:
        host = self.tiers[HOST]
        if host.used_bytes + c.nbytes > host.budget_bytes:
            # no eviction for a prefetch: measured, evicting chunks needed later to make
            # room moved 17% more bytes per step and made it slower, not faster
            return
        disk = self.tiers[DISK]
        with self.tracer.chunk_memory():
            new = host.allocate(c.capacity, c.dtype)
        done = self._reader.submit(disk.spill_file(), c.disk_offset, new)
        self.arriving[id(c)] = Arrival(DISK, done, c.disk_offset)
        c.disk_offset = None
        c.payload = new
        self.payloads.add(c)
        self.account(c, DISK, HOST)
        self.prefetched["disk->host"] = self.prefetched.get("disk->host", 0) + 1

    def _to_device(self, c: Chunk, allowed: int) -> None:
        device = self.tiers[DEVICE]
        if device.used_bytes + self.sending_bytes + c.nbytes > allowed:
            return  # never evicts for a prefetch on the device: A_j is tight there
        with self.tracer.chunk_memory():
            new = device.allocate(c.capacity, c.dtype)
        source = c.payload
        done = self._copier.copy(new, source)
        self.payloads.remove(c)
        self.arriving[id(c)] = Arrival(HOST, done, source=source, nbytes=c.nbytes)
        c.payload = new
        self.payloads.add(c)
        self.account(c, HOST, DEVICE)
        self.prefetched["host->device"] = self.prefetched.get("host->device", 0) + 1

    def send(self, c: Chunk, held: int | None = None) -> bool:
        """Start moving `c` from the device to the host on the copy stream, if the host
        has room; whether it did (a chunk with a current host copy goes back at once).
        `held`: the device bytes its payload keeps until the copy is done (a ZeRO group's
        whole buffer, when `c` is a slice of it), if not its own."""
        if not self._copier.enabled or c.tier != DEVICE or id(c) in self.arriving:
            return False
        if c.host_copy is not None:
            self._back_to_host_copy(c)
            return True
        return self._to_host(c, held)

    # -- host copies of clean chunks ([Note: clean chunks]) -----------------------------

    def _keep_host_copy(self, c: Chunk, source: torch.Tensor) -> None:
        """`c` moved from the host to the device, from `source`: keep that as the chunk's
        host copy if the host budget has room for it, else give it back."""
        host = self.tiers[HOST]
        if self.keep_host_copies and host.used_bytes + c.nbytes <= host.budget_bytes:
            c.host_copy = source
            host.add(c.nbytes)
            self.host_copy_bytes += c.nbytes
        else:
            self._release_source(source)

    def _release_source(self, buf: torch.Tensor) -> None:
        """Give a host buffer back, or hold it while a copy in may still read it."""
        done = self._reading.pop(buf.data_ptr(), None)
        if done is not None and not done.query():
            self._held.append((buf, done))
        else:
            self.tiers[HOST].release(buf)

    def _release_held(self) -> None:
        """Give back the held sources whose copies are done."""
        still = []
        for buf, done in self._held:
            if done.query():
                self.tiers[HOST].release(buf)
            else:
                still.append((buf, done))
        self._held = still

    def _writable(self, buf: torch.Tensor) -> None:
        """The host may write `buf` now: wait for a copy in that may still read it."""
        done = self._reading.pop(buf.data_ptr(), None)
        if done is not None:
            done.synchronize()

    def drop_host_copy(self, c: Chunk) -> None:
        """`c` may be written where it is: its host copy no longer holds its bytes."""
        if c.host_copy is None:
            return
        host = self.tiers[HOST]
        self._release_source(c.host_copy)
        host.remove(c.nbytes)
        self.host_copy_bytes -= c.nbytes
        c.host_copy = None

    def drop_host_copies(self, need: int) -> None:
        """Give back host copies (in chunk order) until `need` more bytes fit the host."""
        host = self.tiers[HOST]
        for c in list(self._with_host_copy()):
            if host.used_bytes + need <= host.budget_bytes:
                return
            self.drop_host_copy(c)

    def _with_host_copy(self) -> Iterable[Chunk]:
        for chunks in self._lists.values():
            yield from (c for c in chunks if c.host_copy is not None)

    def _back_to_host_copy(self, c: Chunk) -> None:
        """Evict `c` from the device to its current host copy: no bytes move."""
        self._writable(c.host_copy)  # the host may update it now (Adam)
        with self.tracer.chunk_memory():
            self.payloads.remove(c)
            c.payload, c.host_copy = c.host_copy, None
            self.payloads.add(c)
        self.tiers[DEVICE].remove(c.nbytes)  # its host bytes were counted all along
        self.host_copy_bytes -= c.nbytes
        c.tier = HOST
        self.clean_evictions += 1

    def _to_host(self, c: Chunk, held: int | None = None) -> bool:
        host = self.tiers[HOST]
        if host.used_bytes + c.nbytes > host.budget_bytes:
            return False
        with self.tracer.chunk_memory():
            new = host.allocate(c.capacity, c.dtype)
        done = self._copier.copy(new, c.payload)  # the device block is kept until it is done
        self.payloads.remove(c)
        self.tiers[DEVICE].release(c.payload)
        self.arriving[id(c)] = Arrival(DEVICE, done, nbytes=held or c.nbytes)
        with self.tracer.chunk_memory():
            c.payload = new
        self.payloads.add(c)
        self.account(c, DEVICE, HOST)
        self.prefetched["device->host"] = self.prefetched.get("device->host", 0) + 1
        return True

    def close(self) -> None:
        for b, done in self._held:
            done.synchronize()
            self.tiers[HOST].release(b)
        self._held.clear()
        self._reading.clear()
        self._reader.close()
