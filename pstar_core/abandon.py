"""Giving up an iteration: what a failure inside forward, backward or step leaves behind.

An exception in the middle of an iteration leaves tensors in COMPUTE, groups gathered,
gradients half accumulated and a warm-up trace half recorded. `IterationGuard` puts the
engine back between iterations: the gradients accumulated since the last `step()` are
dropped (parameters keep their values), the trace being recorded is discarded (the next
iteration records one again) and the profiler is stopped. Under ZeRO every rank gives up
the same iteration (see [Note: ranks fail together] in zero.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from pstar_core.chunk import TensorState
from pstar_core.excluded import ExcludedParams
from pstar_core.manager import ChunkManager, TrainingPhase
from pstar_core.optim import ChunkAdamW

log = logging.getLogger(__name__)


class IterationGuard:
    """Abandons the iteration under way, on an error inside it or when asked."""

    def __init__(
        self, manager: ChunkManager, optimizer: ChunkAdamW, excluded: ExcludedParams
    ) -> None:
        self.manager = manager
        self.optimizer = optimizer
        self.excluded = excluded

    @contextlib.contextmanager
    def on_error(self) -> Iterator[None]:
        """Abandon the iteration if the block raises; the error goes on to the caller."""
        try:
            yield
        except BaseException as e:
            try:
                self.abandon(e)
            except Exception:  # the original error is what the caller needs to see
                log.exception("could not reset the engine after an error")
            raise

    def abandon(self, error: BaseException) -> None:
        """Give up the iteration because of `error` (told to the other ranks under ZeRO)."""
        m = self.manager
        self.optimizer.beside.abandon()  # before anything moves the chunks it holds
        m.tracer.abort()
        m.groups.drop_all()
        m.release_all(TensorState.HOLD)
        if m.zero.enabled:  # its groups' memory is free for stand-ins (see zero.py)
            m.zero.report_failure(error)
        m.reset_after_forward()
        if any(s.state is TensorState.HOLD_AFTER_BWD for s in m.slots) or m.grad_accum:
            self.optimizer.drop_grads()
        self.excluded.zero_grad()
        m.phase = TrainingPhase.IDLE


__all__ = ["IterationGuard"]
