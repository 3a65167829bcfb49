"""What the worker loop tells the world in a run without the service (`pstar train`).

A `service.worker.loop.Sink` for files and the command line: rank 0 appends a metrics line to
`<run dir>/metrics.jsonl` every `log_every` steps and at the last (the same names and
meanings a job's metrics have, plus the run's `world_size` and `attempt_resumed`), and
hands every step and phase to callbacks (the CLI's progress bar). The values before
training, the last step's and the engine's latest stats stay on the object for
the run's summary.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.spec.run_plan import RunPlan

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, Any]], None]


class RunLog:
    attempt = 1  # one attempt: a lost worker group is restarted by Ray within it

    def __init__(
        self,
        run: RunPlan,
        run_dir: Path,
        log_every: int,
        rank: int = 0,
        on_step: StepCallback | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.run, self.rank, self.log_every = run, rank, log_every
        self.path = run_dir / "metrics.jsonl"
        self.on_step, self.on_phase = on_step, on_phase
        self._phase: str | None = None
        self.before: dict[str, Any] = {}
        self.last: dict[str, Any] = {}
        self.latest_stats: dict[str, Any] = {}
        self.run_fields: dict[str, Any] = {"attempt_resumed": 0}

    def _say(self, msg: str) -> None:
        if self.rank == 0 and self.on_phase:
            self.on_phase(msg)
        log.info("%s", msg)

    def phase(self, detail: str) -> None:
        if detail != self._phase:
            self._phase = detail
            self._say(detail)

    def event(self, message: str, **data: Any) -> None:
        self._say(message)

    def runtime(self, values: dict[str, Any]) -> None:
        self.run_fields["world_size"] = values["world_size"]

    def running(self) -> None:
        pass

    def resumed(self, step: int) -> None:
        self.run_fields["attempt_resumed"] = 1
        self._say(f"resumed from the checkpoint at step {step}")

    def metrics(
        self, step: int, values: dict[str, Any], note: str = "", total: int | None = None
    ) -> None:
        if step == 0:  # before training (held-out loss)
            self.before = dict(values)
            return
        self.last = dict(values)
        if self.rank == 0 and self.on_step:
            self.on_step(step, self.last)
        if self.rank == 0 and (step % self.log_every == 0 or step == total):
            with self.path.open("a") as f:
                f.write(json.dumps({**values, "step": step, **self.run_fields}) + "\n")

    def values_at(self, step: int) -> dict[str, Any]:
        """The line of `step` in the metrics file (what a resumed run continues from)."""
        if step == 0 or not self.path.is_file():
            return {}
        lines = (json.loads(x) for x in self.path.read_text().splitlines() if x.strip())
        return next((m for m in lines if m.get("step") == step), {})

    def last_values(self) -> dict[str, Any]:
        return dict(self.last)

    def stats(self, stats: dict[str, Any]) -> None:
        self.latest_stats = stats

    def checkpoint(self, step: int, values: dict[str, Any], final: bool, dir_name: str) -> None:
        pass  # Ray Train keeps its registry; the run directory holds it (`ray/`)

    def early_stopping(self, view: dict[str, Any]) -> None:
        self.run_fields["early_stopping"] = view

    def pause_requested(self) -> bool:
        return False  # a run without the service stops with Ctrl-C and resumes from its dir

    def paused(self, step: int) -> None:
        pass

    def finished(self, final: dict[str, Any]) -> None:
        pass  # run_loop returns the final values to the front, which writes the summary

    def flush(self) -> bool:
        return True
