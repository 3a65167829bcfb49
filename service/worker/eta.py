"""When a run will finish, from what its steps have taken so far (`estimated_finish`).

The estimate is the wall time the steps of this attempt took per step, everything between
two steps included (evaluations, checkpoints, writes to the store), times the steps left,
plus what comes after the last step: the final evaluation of the whole validation file
(as long as the one before training took, when it ran) and the final checkpoint and export
(as long as the slowest checkpoint so far). The first step of an attempt is left out of the
rate: it records the warm-up trace (and, on a GPU, compiles), and is not what the others
take. A step's rate moves with the machine's load; taken over the whole attempt it is a
mean, not the last step's noise.
"""

from __future__ import annotations

import time


class Eta:
    def __init__(self, total_steps: int, clock=time.monotonic, wall=time.time) -> None:
        self.total = total_steps
        self.clock, self.wall = clock, wall
        self.full_eval_s = 0.0  # the whole validation file, once
        self.checkpoint_s = 0.0  # the slowest checkpoint so far
        self._since: float | None = None  # the end of the attempt's first step
        self._steps_since = 0

    def full_eval(self, seconds: float) -> None:
        self.full_eval_s = max(self.full_eval_s, seconds)

    def checkpoint(self, seconds: float) -> None:
        self.checkpoint_s = max(self.checkpoint_s, seconds)

    def step_done(self, done: int) -> int | None:
        """After step `done` (1-based) of the run: the expected finish, UNIX seconds
        (None until a rate is known: the attempt's first step only records the trace)."""
        now = self.clock()
        if self._since is None:
            self._since = now
            return None
        self._steps_since += 1
        rate = (now - self._since) / self._steps_since
        left = self.total - done
        after = self.full_eval_s + self.checkpoint_s if left > 0 else 0.0
        return round(self.wall() + left * rate + after)
