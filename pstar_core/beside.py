"""Host Adam beside backward: a chunk's Adam runs on the host while backward goes on.

[Note: Adam beside backward] With some chunks' Adam on the host (a model larger than the
GPU), a step used to be backward, then those chunks' Adam one after another. Their
gradients already crossed to the host during backward (`Residency._send_done_for_host_
adam`), but the host sat idle until backward ended. On an H200 a 1.1B GPT under a budget
of N + P/2 spent 213 ms of its 337 ms step in host Adam after 117 ms of forward and
backward (docs/gpu.md): the host's work was serial with the GPU's.

A chunk's gradients are final once backward is done with it: the trace says its next use
is its Adam moment. If the step follows this backward at once (`Engine.backward_and_step`)
and nothing needs every gradient before the first update (no fp16 overflow check, no
clipping by the global norm), that chunk's Adam can run then, on a thread of its own,
beside backward: the kernel releases the GIL and reads and writes only the chunk's host
payloads. The main thread keeps all the bookkeeping. It pins the chunk and its optimizer
states while the thread has them (no move, eviction or spill), and at the step it plays
the chunk's Adam moment as before (the trace does not change), waiting for the thread's
result instead of running the kernel.

On an H200 the first version of this was no faster (`beside_speedup` 0.97): 9 of the 11
chunks of that 1.1B GPT started beside backward, but the two whose parameters backward's
last operators held were left to the step, which copied their gradients out and ran their
Adam on the main thread while the Adam thread still ran the others: two kernels on the
same 16 cores, 39 ms a chunk against 19 alone. So once backward's host side is over, what
its last operators held leaves for the host too, and the engine waits for the copies out
one at a time, in the order they were issued, starting each chunk's Adam as its gradients
land (`drain`; on a GPU the device may still be running backward then). Chunks run one at
a time, on the one thread: each kernel uses every core of the host, and a chunk left to
its moment in the step, its Adam on the host, waits for those under way before it runs
(`quiet`), as two kernels at once share the cores and the memory bandwidth and each runs
slower (a chunk whose Adam runs on the device goes on beside them). While an Adam runs, a
copy is waited for by asking with short sleeps: a CUDA event's wait spins on a core.

Under ZeRO an own chunk's gradients are final once its group's reduce-scatter is done.
Such reductions were settled at the end of backward; while Adam may start beside it, one
found done at a backward operator (`Work.is_completed()`, no wait) is finished there, and
the own chunk leaves the group's buffer for the host by a copy out, the buffer counted
as device memory until the copy is done (`GatheredGroups.settle_completed`).

Exact: the same kernel on the same inputs, so losses are bitwise those of `backward()`
then `step()`. Not undoable: if backward fails after some chunks were updated, they keep
their update. The engine then refuses to go on until a checkpoint or a training state is
loaded (`torn`), rather than train on from a step applied to part of the model.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Protocol

from pstar_core.chunk import TRAINABLE_LISTS, Chunk, ChunkType, TensorSlot
from pstar_core.placement import adam_tier
from pstar_core.tiers import DEVICE, HOST
from pstar_core.tracer import profiled

if TYPE_CHECKING:
    from pstar_core.kernels import AdamSegment
    from pstar_core.manager import ChunkManager


# how long the wait for a chunk's gradients to land sleeps between asking (`drain`)
LANDING_POLL_S = 1e-4


class Stepper(Protocol):
    """What of the optimizer (`optim.ChunkAdamW`) runs a chunk's Adam; `hyper` is its
    `StepHyper` or None (the config's)."""

    def segments(self, chunk: Chunk, hyper: Any) -> list[AdamSegment]: ...

    def to_fold(self, index: int) -> list[TensorSlot]: ...

    def adam(
        self, i: int, chunk: Chunk, segs: list[AdamSegment], grad_scale: float, hyper: Any
    ) -> None: ...


class AdamBesideBackward:
    """The chunks whose Adam runs beside the backward under way (see the note above)."""

    def __init__(self, manager: ChunkManager, optimizer: Stepper) -> None:
        self.manager = manager
        self.optimizer = optimizer
        self._pool: ThreadPoolExecutor | None = None
        self._armed = False
        self._hyper: Any = None
        self._waiting: list[Chunk] = []  # host-Adam param chunks not started yet
        self._running: dict[int, tuple[Future, list[Chunk]]] = {}  # by chunk index
        self._started = 0  # chunks started beside the backward of the step under way
        self.last_step_chunks = 0  # chunks whose Adam ran beside the last step's backward
        self.torn: str | None = None  # why the engine must load a state before going on
        manager.groups.for_host_adam = self._for_host_adam

    def _for_host_adam(self, c: Chunk) -> bool:
        """Whether a reduced own chunk's gradients go to the host now (groups.py): Adam
        may start beside this backward, and the chunk's next use is Adam on the host."""
        return self._armed and self.manager.residency.bound_for_host_adam(c)

    def arm(self, hyper: Any) -> None:
        """The backward about to run is its step's last, and the step follows it at once
        with `hyper`: Adam may start on each host chunk backward is done with."""
        m = self.manager
        self._armed, self._hyper, self._started = True, hyper, 0
        self._waiting = [
            c
            for c in m.own_chunks([ChunkType.PARAM])
            if adam_tier(m.device_adam, c.index) == HOST and any(s.trainable for s in c.slots)
        ]

    def poll(self) -> None:
        """A backward operator starts: start Adam on every waiting chunk that is ready."""
        if not self._armed or not self._waiting:
            return
        m = self.manager
        if m.tracer.trace is None or not m.tracer.following:
            return
        if m.zero.enabled:  # reductions done leave for the host now (groups.py)
            m.groups.settle_completed()
        still = []
        for c in self._waiting:
            if self._ready(c):
                self._start(c)
            else:
                still.append(c)
        self._waiting = still

    def drain(self) -> None:
        """Backward's host side is over (on a GPU the device may still be running it): send to
        the host what backward was done with last, then start each waiting chunk as its
        gradients land, waiting for one copy out at a time in the order they were issued
        (the order backward was done with them). A chunk with no copy under way is left
        to its moment in the step."""
        if not self._armed or not self._waiting:
            return
        m = self.manager
        if m.tracer.trace is None or not m.tracer.following:
            return
        m.residency.send_done_after_backward()
        while True:
            self.poll()
            c = self._next_landing()
            if c is None:
                return
            with profiled("pstar::wait gradients for adam beside backward"):
                self._await_landing(c)

    def _await_landing(self, c: Chunk) -> None:
        """Wait for `c`'s copy out. While an Adam runs, by asking with short sleeps: a
        CUDA event's own wait spins on a core, which the kernel under way on every core
        would then share (its slowest thread sets its time). With none running, the
        plain wait (without a modeled link the fake device's copies land only when waited
        for)."""
        transfers = self.manager.residency.transfers
        while id(c) in transfers.arriving and not transfers.landed_on_host(c):
            if all(done.done() for done, _ in self._running.values()):
                transfers.arrive(c)
                return
            time.sleep(LANDING_POLL_S)

    def _next_landing(self) -> Chunk | None:
        """Of the waiting chunks' copies out to the host, the one issued first."""
        mine = {id(x): x for c in self._waiting for x in self._chunks(c.index)}
        for key, a in self.manager.residency.transfers.arriving.items():
            if a.src == DEVICE and key in mine:
                return mine[key]
        return None

    def _ready(self, c: Chunk) -> bool:
        """Backward is done with `c` (its next traced use is its Adam, on the host), its
        group is reduced (ZeRO), and it and its optimizer states are all on the host."""
        m = self.manager
        if not m.residency.bound_for_host_adam(c):
            return False
        if m.zero.enabled and not m.groups.settled(c):
            return False
        return all(self._landed(x) for x in self._chunks(c.index))

    def _chunks(self, index: int) -> list[Chunk]:
        lists = self.manager.lists
        chunks = [lists[k][index] for k in TRAINABLE_LISTS]
        acc = self.manager.grad_accum.get(index)
        return chunks + ([acc] if acc is not None else [])

    def _landed(self, c: Chunk) -> bool:
        """`c` is on the host with its bytes there (a copy out done, waited for without a
        stall), and no collective holds it."""
        return not c.pins and self.manager.residency.transfers.landed_on_host(c)

    def _start(self, c: Chunk) -> None:
        """Fold the micro-batch's gradients (with accumulation) and run Adam on `c` on the
        thread, as `ChunkAdamW.step` would at its moment."""
        opt, index = self.optimizer, c.index
        acc = self.manager.grad_accum.get(index)
        segs = opt.segments(c, self._hyper)
        if not segs:
            return  # no gradient: the step passes it by too
        folded = opt.to_fold(index)
        chunks = self._chunks(index)
        for x in chunks:
            x.pins += 1

        def run() -> None:
            if acc is not None:
                for s in folded:
                    acc.flat(s).add_(c.flat(s))
            opt.adam(index, c, segs, 1.0, self._hyper)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pstar-adam-beside")
        self._running[index] = (self._pool.submit(run), chunks)
        self._started += 1

    def quiet(self, index: int) -> None:
        """Chunk `index`'s Adam runs on the main thread now: if on the host, wait for the
        updates under way first (beside them it would share the host's cores and memory
        bandwidth, each running slower); on the device it runs beside them."""
        if self._running and adam_tier(self.manager.device_adam, index) == HOST:
            with profiled("pstar::wait adam beside backward"):
                wait([done for done, _ in self._running.values()])

    def started(self, index: int) -> bool:
        return index in self._running

    def finish(self, index: int) -> None:
        """The step reached chunk `index`'s Adam moment: wait for its update (raising the
        thread's error, if any) and unpin its chunks."""
        done, chunks = self._running.pop(index)
        try:
            done.result()
        finally:
            for x in chunks:
                x.pins -= 1
        self.last_step_chunks += 1

    def step_begins(self) -> None:
        """The step starts: no more chunks start beside it."""
        self._armed, self._waiting = False, []
        self.last_step_chunks = 0

    def step_done(self) -> None:
        """The step is over (every chunk updated, or none: an fp16 overflow)."""
        self._started = 0

    def abandon(self) -> None:
        """The iteration is given up: wait for the updates under way (nothing is left
        running on chunks the engine goes on with); if any chunk was updated beside its
        backward, the model is part-way through a step (`torn`)."""
        updated = self._started
        for index in list(self._running):
            with contextlib.suppress(Exception):  # the iteration's own error is raised
                self.finish(index)
        self._armed, self._waiting, self._started = False, [], 0
        if updated:
            self.torn = (
                f"the iteration failed after Adam had updated {updated} chunk(s) beside "
                "backward (backward_and_step), so the model holds a step applied to part of "
                "it; load a checkpoint (load_checkpoint) or a training state "
                "(load_training_state) before training on"
            )

    def close(self) -> None:
        self.abandon()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["AdamBesideBackward"]
