"""The runtime memory tracer: moments, measured non-model memory, chunk use lists.

A moment is the start of an operator: a module's forward or backward, or Adam on one
chunk. During the warm-up iteration the tracer records, per moment i,
- R_i: device memory really in use, as the *peak* between moment i and moment i+1,
- C_i: chunk bytes on the device at moment i,
- N_i = R_i - C_i, the non-model memory (activations, temporaries, gradients in flight),
and for each chunk the moments at which it is used. Later iterations repeat the same
moments, so these lists drive eviction (OPT) and placement.

What is measured:
- On CUDA: the caching allocator's `memory_allocated` and `max_memory_allocated`, with
  the peak reset at each moment. (Not exercised on a machine without a GPU.)
- On the CPU: every allocation and free of the iteration, from the PyTorch profiler's
  memory events (`profile_memory=True`), which come from the CPU allocator itself, so a
  temporary an operator allocates and frees inside its forward counts. Chunk payload
  allocations are made inside `record_function("pstar.chunk_mem")` ranges and left out;
  the running sum of the rest, maximised between moment marks, is the non-model
  memory. Moments are marked with `record_function("pstar.moment")`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

CHUNK_MEM = "pstar.chunk_mem"
MOMENT = "pstar.moment"


@dataclass
class Trace:
    """What warm-up measured; reused by every later iteration."""

    names: list[str] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)  # C_i
    non_model: list[int] = field(default_factory=list)  # N_i
    uses: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    @property
    def moments(self) -> int:
        return len(self.names)

    @property
    def peak_non_model(self) -> int:
        return max(self.non_model, default=0)

    def non_model_around(self, moment: int) -> int:
        """max(N_j, N_{j+1}): what the operator starting at moment j may need."""
        if not self.non_model:
            return 0
        j = min(max(moment, 0), len(self.non_model) - 1)
        return max(self.non_model[j], self.non_model[min(j + 1, len(self.non_model) - 1)])


class MemoryTracer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.moment = -1
        self.tracing = False
        self.trace: Trace | None = None  # set when warm-up is done
        self._building = Trace()
        self._profiler: torch.profiler.profile | None = None
        self._cuda_peaks: list[int] = []

    # -- iteration control -----------------------------------------------------------------

    def start_iteration(self) -> None:
        self.moment = -1
        if self.trace is None and not self.tracing:
            self.tracing = True
            self._building = Trace()
            if self.device.type == "cpu":
                self._profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
                )
                self._profiler.__enter__()
            else:  # pragma: no cover - CUDA only
                self._cuda_peaks = []
                torch.cuda.reset_peak_memory_stats(self.device)

    def end_iteration(self) -> None:
        if not self.tracing:
            return
        self.tracing = False
        trace = self._building
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            trace.non_model = _cpu_non_model(self._profiler, trace.moments)
            self._profiler = None
        else:  # pragma: no cover - CUDA only
            self._close_cuda_window()
            trace.non_model = [
                max(0, r - c) for r, c in zip(self._cuda_peaks, trace.chunk_bytes, strict=False)
            ]
        self.trace = trace

    # -- moments -------------------------------------------------------------------------

    def new_moment(self, name: str, device_chunk_bytes: int) -> int:
        self.moment += 1
        if self.tracing:
            t = self._building
            t.names.append(name)
            t.chunk_bytes.append(device_chunk_bytes)
            if self._profiler is not None:
                with record_function(MOMENT):
                    pass
            elif self.moment > 0:  # pragma: no cover - CUDA only
                self._close_cuda_window()
        return self.moment

    def note_use(self, key: tuple[str, int]) -> None:
        if self.tracing:
            lst = self._building.uses.setdefault(key, [])
            if not lst or lst[-1] != self.moment:
                lst.append(self.moment)

    def uses_of(self, key: tuple[str, int]) -> list[int]:
        return self.trace.uses.get(key, []) if self.trace else []

    @contextlib.contextmanager
    def chunk_memory(self) -> Iterator[None]:
        """Wrap chunk payload allocation/free so the tracer does not count it as non-model."""
        if self._profiler is not None:
            with record_function(CHUNK_MEM):
                yield
        else:
            yield

    def _close_cuda_window(self) -> None:  # pragma: no cover - CUDA only
        """R of the moment that just ended: the allocator's peak since the last reset."""
        self._cuda_peaks.append(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)


def _cpu_non_model(prof: torch.profiler.profile, moments: int) -> list[int]:
    """Per moment, the peak of live non-chunk bytes allocated in this iteration.

    Only blocks allocated inside the traced iteration count, tracked by address: a free
    of a block allocated earlier (or of a chunk payload, allocated under CHUNK_MEM) is
    ignored, so the running total cannot drift below what is really live.
    """
    marks: list[int] = []
    allocs: list[tuple[int, int, int, bool]] = []  # (time, ptr, +/- bytes, chunk memory)
    stack = [(root, False) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, in_chunk = stack.pop()
        if node.name == MOMENT:
            marks.append(node.start_time_ns)
        inside = in_chunk or node.name == CHUNK_MEM
        fields = node.extra_fields
        if hasattr(fields, "alloc_size"):
            allocs.append((node.start_time_ns, fields.ptr, fields.alloc_size, inside))
        stack.extend((child, inside) for child in node.children)
    marks.sort()
    allocs.sort(key=lambda a: a[0])
    out = [0] * moments
    if not moments:
        return out
    # Memory used between the start of the iteration and the first moment counts for
    # moment 0 (the model's own forward may allocate before its first hooked operator).
    live: dict[int, int] = {}
    total, peak, m = 0, 0, 0
    for t, ptr, nbytes, chunk_mem in allocs:
        while m + 1 < len(marks) and marks[m + 1] <= t:
            out[m] = max(out[m], peak)
            m += 1
            peak = total
        if nbytes > 0 and not chunk_mem:
            live[ptr] = nbytes
            total += nbytes
            peak = max(peak, total)
        elif nbytes < 0 and ptr in live:
            total -= live.pop(ptr)
    while m < min(len(marks), moments):
        out[m] = max(out[m], peak)
        m += 1
        peak = total
    return out
