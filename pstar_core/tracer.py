"""The runtime memory tracer: moments, measured non-model memory, chunk use lists.

A moment is the start of an operator: a module's forward or backward, or Adam on one
chunk. During the warm-up iteration the tracer records, per moment i,
- R_i: device memory really in use, as the *peak* between moment i and moment i+1,
- C_i: chunk bytes on the device at moment i,
- N_i = R_i - C_i, the non-model memory (activations, temporaries, gradients in flight),
and for each chunk the moments at which it is used. Later iterations repeat the same
moments, so these lists drive eviction (OPT) and placement; every iteration is checked
against the trace, and one that departs from it is handled (see [Note: departures]).
The device's peak is taken per moment, N_i plus the most chunk bytes of window i, per
iteration and since the start, never as the sum of two peaks from different moments.

What is measured:
- On an accelerator (CUDA, or the test suite's second device, which has the same
  allocator statistics): its caching allocator's `memory_allocated` and
  `max_memory_allocated`, with the peak reset at each moment.
- On the CPU: every allocation and free of the iteration, from the PyTorch profiler's
  memory events (`profile_memory=True`), which come from the CPU allocator itself, so a
  temporary an operator allocates and frees inside its forward counts. Chunk payload
  allocations are made inside `record_function("pstar.chunk_mem")` ranges and left out;
  the running sum of the rest, maximised between moment marks, is the non-model
  memory. Moments are marked with `record_function("pstar.moment")`.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function

from pstar_core.devices import AllocatorCounters, AllocatorReading, capabilities
from pstar_core.tiers import return_freed_host_memory

log = logging.getLogger(__name__)

CHUNK_MEM = "pstar.chunk_mem"
MOMENT = "pstar.moment"


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `record_function` range called `name` while a profiler runs (so `pstar::access`,
    `pstar::adam`, moves and collectives show in traces), else nothing: opening and
    closing a range goes through the dispatcher even with no profiler, 6 us alone and
    ~45 us inside a step (the other core spinning in OpenMP), at ~160 Accesses a step."""
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


@dataclass
class Trace:
    """What a traced iteration measured; reused by every later iteration."""

    names: list[str] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)  # C_i: on the device at moment i
    chunk_peak: list[int] = field(default_factory=list)  # the most chunk bytes in window i
    # the least chunk bytes in window i once its operator's chunks were in place
    chunk_compute: list[int] = field(default_factory=list)
    non_model: list[int] = field(default_factory=list)  # N_i, as measured
    # what a decision set aside at moment i beyond what was measured there (placement:
    # device Adam's temporaries, where the traced step ran Adam on the host); kept apart
    # so that a reported N_i is always a measurement (`need` is what admission uses)
    reserved: dict[int, int] = field(default_factory=dict)
    uses: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # on an accelerator, the caching allocator's reserved peak in window i (what the device
    # really holds; above allocated by the blocks it caches, or fragmentation)
    reserved_peak: list[int] = field(default_factory=list)
    # on an accelerator, non-chunk memory live at the start of moment i (see [Note: memory
    # carried into an iteration])
    live_start: list[int] = field(default_factory=list)
    shape: BatchShape | None = None  # the batch it was traced with (None: not known)

    @property
    def moments(self) -> int:
        return len(self.names)

    @property
    def peak_non_model(self) -> int:
        """The most non-model memory measured at a moment."""
        return max(self.non_model, default=0)

    def need(self, moment: int) -> int:
        """Non-model memory moment i may use: what was measured, or what was set aside
        there if more."""
        return max(self.non_model[moment], self.reserved.get(moment, 0))

    @property
    def peak_need(self) -> int:
        return max((self.need(i) for i in range(len(self.non_model))), default=0)

    def non_model_around(self, moment: int) -> int:
        """max(N_j, N_{j+1}) (each with what was set aside there): what the operator
        starting at moment j may need."""
        if not self.non_model:
            return 0
        j = min(max(moment, 0), len(self.non_model) - 1)
        return max(self.need(j), self.need(min(j + 1, len(self.non_model) - 1)))

    def device_peak(self) -> int:
        """max over moments of N_i + the chunk bytes of window i: the device's peak."""
        pairs = zip(self.non_model, self.chunk_peak, strict=False)
        return max((n + c for n, c in pairs), default=0)


@dataclass(frozen=True)
class BatchShape:
    """The size of a batch as far as non-model memory goes: tokens (elements of the
    largest input tensor) and sequence length (its last dimension)."""

    tokens: int
    seq: int

    def scale_over(self, traced: BatchShape) -> float:
        """How much more non-model memory this batch may need than the traced one: linear
        in tokens, and once more in sequence length for attention scores (conservative
        for every part of a transformer's activations)."""
        return max(1.0, self.tokens / traced.tokens) * max(1.0, self.seq / traced.seq)


class Mode(enum.Enum):
    """What the tracer does in the pass under way (an iteration, or a forward outside one)."""

    IDLE = "idle"  # nothing under way
    TRACING = "tracing"  # recording a trace (warm-up, or a re-trace for a larger batch)
    FOLLOWING = "following"  # an iteration that repeats the trace moment for moment
    OFF_TRACE = "off_trace"  # departed from the trace, or an evaluation forward


class MemoryTracer:
    """Records a trace in the warm-up iteration, then checks every iteration against it.

    [Note: departures] Fine-tuning batches change shape and evaluation runs forwards
    between steps, so the trace of one iteration does not always hold:
    - an iteration whose batch has more tokens than the traced one is traced again
      (a re-trace: the warm-up's conservative limits for one iteration, then the new,
      larger trace is kept; smaller batches are safe under a larger trace);
    - an iteration whose operators stop matching the trace (another operator at moment
      i, or more moments) runs the rest of the way OFF_TRACE: the device may hold
      budget - peak N x (batch scale) of chunks, and victims are chosen by LRU, since
      the traced future no longer applies;
    - a forward outside an iteration (evaluation, under no_grad or eval()) runs
      OFF_TRACE from its first moment and leaves the trace and its moments alone.
    Departures and re-traces are counted and logged once each.
    """

    def __init__(self, device: torch.device, audit: bool = False) -> None:
        self.device = device
        self.audit = audit  # measure non-model memory in every pass, not only when tracing
        self.moment = -1
        self.mode = Mode.IDLE
        self.trace: Trace | None = None  # set when the first warm-up is done
        self.scale = 1.0  # non-model scale of an OFF_TRACE pass over the trace's batch
        self.departures = 0  # iterations that departed from the trace (re-traced or not)
        self.retraces = 0
        self.untraced_passes = 0  # forwards outside an iteration (evaluation)
        self.peak_device_bytes = 0  # max over all passes of N_i + chunk peak of window i
        self.last_peak_device_bytes = 0  # ... of the last complete iteration
        self.measured_peak_device_bytes = 0  # audit: with N_i measured in every pass
        self.last_measured_peak_device_bytes = 0
        self._pass = Trace()  # this pass's moments (a trace in the making when TRACING)
        self._profiler: torch.profiler.profile | None = None  # measuring on the CPU
        self._measuring_device = False  # measuring with the device allocator's peaks
        self._device_peaks: list[int] = []
        self._logged: set[str] = set()
        # the device allocator's counters, one read per moment (see [Note: reading the
        # allocator] in devices.py); None on the CPU
        self.counters = AllocatorCounters(device) if capabilities(device).allocator_stats else None
        # [Note: memory carried into an iteration] The trace's N_j are what the warm-up
        # saw, but a caller can hold device memory the warm-up did not have: `out =
        # engine(x)` in a loop keeps the last step's logits alive until the next forward
        # returns (B x S x V values). So on an accelerator the tracer reads, at each
        # moment's start, the device memory that is not chunks, and what exceeds the
        # warm-up's at the same moment is carried on top of N_j for that moment (off the
        # trace: on top of the peak, against the first moment's). One counter read each.
        self.carry_bytes = 0

    @property
    def tracing(self) -> bool:
        return self.mode is Mode.TRACING

    @property
    def following(self) -> bool:
        return self.mode is Mode.FOLLOWING

    # -- passes --------------------------------------------------------------------------

    def start_iteration(self, shape: BatchShape | None = None) -> None:
        """A training iteration begins (its first forward)."""
        t = self.trace
        if t is None:
            mode = Mode.TRACING
        elif shape is not None and t.shape is not None and shape.tokens > t.shape.tokens:
            self.departures += 1
            self.retraces += 1
            self._log_once(
                "retrace",
                "a batch of %d tokens (sequence %d) is larger than the traced one (%d, "
                "sequence %d): tracing this iteration again",
                shape.tokens,
                shape.seq,
                t.shape.tokens,
                t.shape.seq,
            )
            mode = Mode.TRACING
        else:
            mode = Mode.FOLLOWING
        self._begin(mode, shape)

    def start_untraced_pass(self, shape: BatchShape | None = None) -> None:
        """A forward outside an iteration (evaluation): never part of the trace."""
        self.untraced_passes += 1
        self._begin(Mode.OFF_TRACE if self.trace is not None else Mode.IDLE, shape)

    def _note_live(self, device_chunk_bytes: int, reading: AllocatorReading | None) -> None:
        """At a moment's start: record (tracing) or compare (otherwise) the device memory
        that is not chunks (see [Note: memory carried into an iteration])."""
        if reading is None:
            return
        live = max(0, reading.allocated - device_chunk_bytes)
        self._pass.live_start.append(live)
        self.carry_bytes = self._carry(self.moment, live, self.mode)

    def _carry(self, moment: int, live: int, mode: Mode) -> int:
        t = self.trace
        if mode is Mode.TRACING or t is None or not t.live_start:
            return 0
        if mode is Mode.FOLLOWING and moment < len(t.live_start):
            return max(0, live - t.live_start[moment])
        return max(0, live - t.live_start[0])

    def _begin(self, mode: Mode, shape: BatchShape | None) -> None:
        self.moment = -1
        self.carry_bytes = 0
        self.mode = mode
        self._pass = Trace(shape=shape)
        t = self.trace
        self.scale = shape.scale_over(t.shape) if t and t.shape and shape else 1.0
        if mode is Mode.TRACING or (self.audit and mode is not Mode.IDLE):
            self._start_measuring()

    def end_pass(self) -> bool:
        """The pass under way is over; True if it recorded a new trace."""
        mode, p = self.mode, self._pass
        self.mode = Mode.IDLE
        measured = self._stop_measuring(p)
        if mode is Mode.IDLE:
            return False
        if mode is Mode.TRACING:
            self.trace = p
        else:  # the chunk peaks are this pass's, the non-model bytes the trace's estimate
            p.non_model = self._estimated_non_model(p.moments, mode)
        peak = p.device_peak()
        self.peak_device_bytes = max(self.peak_device_bytes, peak)
        self.last_peak_device_bytes = peak
        if measured:
            self.measured_peak_device_bytes = max(self.measured_peak_device_bytes, measured)
            self.last_measured_peak_device_bytes = measured
        return mode is Mode.TRACING

    def abort(self) -> None:
        """Abandon the pass under way (an exception went through it): stop the profiler,
        keep the old trace; the next iteration starts afresh (a warm-up if none exists)."""
        self.mode = Mode.IDLE
        self.moment = -1
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            _ACTIVE.discard(self)
            with contextlib.suppress(Exception):
                prof.__exit__(None, None, None)

    # -- moments -------------------------------------------------------------------------

    def new_moment(
        self,
        name: str,
        device_chunk_bytes: int,
        window_chunk_peak: int,
        window_compute_low: int | None = None,
    ) -> int:
        """Moment i begins with `device_chunk_bytes` of chunks on the device; the most there
        were since moment i-1 began was `window_chunk_peak`, the least once moment i-1's
        chunks were in place `window_compute_low` (default: the peak)."""
        p = self._pass
        if self.mode is not Mode.IDLE and self.moment >= 0:
            p.chunk_peak.append(window_chunk_peak)
            low = window_chunk_peak if window_compute_low is None else window_compute_low
            p.chunk_compute.append(low)
        self.moment += 1
        if self.mode is Mode.IDLE:
            return self.moment
        p.names.append(name)
        p.chunk_bytes.append(device_chunk_bytes)
        if self.mode is Mode.FOLLOWING:
            t = self.trace
            if self.moment >= t.moments or t.names[self.moment] != name:
                self.mode = Mode.OFF_TRACE
                self.departures += 1
                expected = t.names[self.moment] if self.moment < t.moments else "the end"
                self._log_once(
                    "departure",
                    "iteration departs from the trace at moment %d (%s, traced: %s); the rest "
                    "of it runs with conservative limits",
                    self.moment,
                    name,
                    expected,
                )
        reading = self.counters.read() if self.counters is not None else None
        self._note_live(device_chunk_bytes, reading)
        if self._profiler is not None:
            with record_function(MOMENT):
                pass
        elif self._measuring_device and self.moment > 0:
            self._close_device_window(reading)
        return self.moment

    def close_window(self, window_chunk_peak: int, window_compute_low: int | None = None) -> None:
        """The last window of the pass ends (before `end_pass`)."""
        if self.mode is not Mode.IDLE and self.moment >= 0:
            self._pass.chunk_peak.append(window_chunk_peak)
            low = window_chunk_peak if window_compute_low is None else window_compute_low
            self._pass.chunk_compute.append(low)

    def note_use(self, key: tuple[str, int]) -> None:
        if self.mode is Mode.TRACING:
            lst = self._pass.uses.setdefault(key, [])
            if not lst or lst[-1] != self.moment:
                lst.append(self.moment)

    def uses_of(self, key: tuple[str, int]) -> list[int]:
        return self.trace.uses.get(key, []) if self.trace else []

    def non_model_allowance(self) -> int:
        """Non-model bytes the device must leave room for from this moment on (FOLLOWING:
        the trace's max(N_j, N_j+1); OFF_TRACE: the traced peak, scaled to the batch)."""
        t = self.trace
        if t is None:
            return 0
        if self.mode is Mode.FOLLOWING:
            return t.non_model_around(self.moment) + self.carry_bytes
        return int(t.peak_need * self.scale) + self.carry_bytes

    def _estimated_non_model(self, moments: int, mode: Mode) -> list[int]:
        """A pass that did not measure: the trace's N_i (or its scaled peak off the trace),
        plus what was carried into each moment."""
        t = self.trace
        if t is None:
            return [0] * moments
        live = self._pass.live_start
        carry = [self._carry(i, live[i], mode) if i < len(live) else 0 for i in range(moments)]
        if mode is Mode.FOLLOWING or (moments <= t.moments and self.scale == 1.0):
            return [t.need(min(i, t.moments - 1)) + carry[i] for i in range(moments)]
        return [int(t.peak_need * self.scale) + carry[i] for i in range(moments)]

    @contextlib.contextmanager
    def chunk_memory(self) -> Iterator[None]:
        """Wrap chunk payload allocation/free so the tracer does not count it as non-model."""
        if self._profiler is not None:
            with record_function(CHUNK_MEM):
                yield
        else:
            yield

    # -- measuring -----------------------------------------------------------------------

    def _start_measuring(self) -> None:
        if not capabilities(self.device).allocator_stats:
            # the profiler has one session per process: another engine's unfinished
            # warm-up (never stepped) gives way and traces again when it goes on
            for other in [t for t in _ACTIVE if t is not self]:
                self._log_once(
                    "profiler",
                    "another engine's trace was still being recorded; it is abandoned "
                    "(that engine traces again at its next iteration)",
                )
                other.abort()
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()
            _ACTIVE.add(self)
        else:  # an accelerator: its caching allocator's peaks (CUDA, or the test device)
            self._device_peaks = []
            self._measuring_device = True
            self.counters.reset_peaks()

    def _stop_measuring(self, p: Trace) -> int:
        """Fill in the pass's N_i if it was measured; the measured device peak (0 if not)."""
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            _ACTIVE.discard(self)
            prof.__exit__(None, None, None)
            p.non_model = _cpu_non_model(prof, p.moments)
            del prof
            return_freed_host_memory()  # the profile's objects and buffers
        elif self._measuring_device:
            self._measuring_device = False
            self._close_device_window(self.counters.read())
            # [Note: C_i on an accelerator] R_i is the allocator's peak over window i, which comes
            # while the operator computes, after its chunks were brought and its group
            # gathered; C_i taken at the moment's start would leave those chunk bytes
            # (a whole gathered group) inside N_i. The least chunk bytes held from then to
            # the window's end is subtracted instead: exact when nothing leaves during the
            # operator, and never more than the chunks there at R's peak (N_i is never
            # underestimated). On the CPU the profiler separates chunk allocations
            # exactly, so this applies to accelerators only.
            p.non_model = [
                max(0, r - c) for r, c in zip(self._device_peaks, p.chunk_compute, strict=False)
            ]
        else:
            return 0
        return p.device_peak()

    def _close_device_window(self, reading: AllocatorReading) -> None:
        """R of the moment that just ended: the allocator's peak since the last reset
        (allocated; reserved kept beside it), from the moment's one reading."""
        self._device_peaks.append(reading.peak_allocated)
        self._pass.reserved_peak.append(reading.peak_reserved)
        self.counters.reset_peaks()

    def _log_once(self, what: str, msg: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg + " (logged once; see stats()['tracer'])", *args)

    def stats(self) -> dict[str, object]:
        t = self.trace
        out: dict[str, object] = {
            "moments": t.moments if t else 0,
            "peak_non_model_bytes": t.peak_non_model if t else 0,
            "non_model_bytes": list(t.non_model) if t else [],
            # what placement set aside beyond the measurement, by moment (not measured)
            "reserved_non_model_bytes": {str(k): v for k, v in t.reserved.items()} if t else {},
            "chunk_bytes": list(t.chunk_bytes) if t else [],
            "chunk_peak_bytes": list(t.chunk_peak) if t else [],
            "chunk_compute_bytes": list(t.chunk_compute) if t else [],
            "names": list(t.names) if t else [],
            "traced_batch": {"tokens": t.shape.tokens, "seq": t.shape.seq}
            if t and t.shape
            else None,
            "peak_reserved_bytes": max(t.reserved_peak, default=0) if t else 0,
            "peak_allocated_bytes": max(
                (n + c for n, c in zip(t.non_model, t.chunk_compute, strict=False)), default=0
            )
            if t
            else 0,
            "carried_bytes": self.carry_bytes,  # see [Note: memory carried into ...]
            "departures": self.departures,
            "retraces": self.retraces,
            "untraced_passes": self.untraced_passes,
            "peak_device_bytes": self.peak_device_bytes,
            "peak_device_bytes_last_iteration": self.last_peak_device_bytes,
        }
        if self.audit:
            out["measured_peak_device_bytes"] = self.measured_peak_device_bytes
            out["measured_peak_device_bytes_last_iteration"] = self.last_measured_peak_device_bytes
        return out


# Tracers with a profiler running: stopped at interpreter exit, since a profiler still
# enabled while Python finalizes crashes the process (SIGSEGV) and hides the real error.
_ACTIVE: weakref.WeakSet[MemoryTracer] = weakref.WeakSet()


@atexit.register
def _stop_profilers() -> None:
    for tracer in list(_ACTIVE):
        tracer.abort()


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
