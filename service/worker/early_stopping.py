"""Early stopping on the validation loss (Together's names: patience, min_delta,
warmup_evals), watched by the one worker loop at every interval evaluation.

An evaluation improves when its loss is below the best so far by more than `min_delta`;
the first `warmup_evals` evaluations only set the best (a loss may rise for a while at the
start of fine-tuning, before it falls); after them, `patience` evaluations in a row that do
not improve stop the run. The loop keeps the model of the best evaluation (a checkpoint of
its own, written when it improves) and, when it stops, trains no further and exports that
model as the fine-tuned one.

An objective may watch another metric (`watched`: its name and a sign that makes lower
better): a reinforcement job watches `valid_reward_mean`, higher being better. The state
keeps the signed value (`best_valid_loss`, its name from before); the job object's view and
the reason a run stopped name the metric and give its own value (`best_value`).

The state is plain JSON: it goes into every checkpoint (`service.worker.loop`), so a resumed
run decides exactly as an uninterrupted one, and onto the job object.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

Verdict = Literal["improved", "wait", "stop"]


@dataclass
class EarlyStopping:
    patience: int
    min_delta: float = 0.0
    warmup_evals: int = 0
    # what the evaluations so far found
    evals: int = 0
    best_valid_loss: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    stopped_at_step: int | None = None
    # what is watched: a metric, and the sign that makes lower better (not state: the run's)
    watched: tuple[str, float] = ("valid_loss", 1.0)

    @classmethod
    def of(
        cls,
        settings: dict[str, Any] | None,
        state: dict[str, Any] | None = None,
        watched: tuple[str, float] = ("valid_loss", 1.0),
    ):
        """From the run's `early_stopping` settings (None: not asked for), a state a
        checkpoint kept, and what the objective watches."""
        if not settings:
            return None
        fields = {
            k: settings[k] for k in ("patience", "min_delta", "warmup_evals") if k in settings
        }
        return cls(**fields, **(state or {}), watched=watched)

    def observe(self, step: int, valid_loss: float) -> Verdict:
        """The loss of the evaluation at `step`: improved (keep this model), wait, or stop."""
        self.evals += 1
        finite = math.isfinite(valid_loss)
        if finite and (
            self.best_valid_loss is None or valid_loss < self.best_valid_loss - self.min_delta
        ):
            self.best_valid_loss, self.best_step = valid_loss, step
            self.evals_without_improvement = 0
            return "improved"
        if self.evals <= self.warmup_evals:
            return "wait"
        self.evals_without_improvement += 1
        if self.evals_without_improvement >= self.patience and self.best_step is not None:
            self.stopped_at_step = step
            return "stop"
        return "wait"

    @property
    def stopped(self) -> bool:
        return self.stopped_at_step is not None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (everything but the settings)."""
        s = asdict(self)
        for k in ("patience", "min_delta", "warmup_evals", "watched"):
            s.pop(k)
        return s

    @property
    def best_value(self) -> float | None:
        """The best evaluation's value of the watched metric, as the metric has it."""
        best = self.best_valid_loss
        return None if best is None else self.watched[1] * best

    def view(self) -> dict[str, Any]:
        """The job object's `early_stopping`: the settings and what was found (the
        watched metric by name, and its best value)."""
        out = {**asdict(self), "stopped": self.stopped}
        out["watched"], out["best_value"] = self.watched[0], self.best_value
        if self.watched[0] != "valid_loss":
            del out["best_valid_loss"]  # a signed value under a loss's name would mislead
        return out

    def reason(self) -> str:
        name, sign = self.watched
        what = "the validation loss" if name == "valid_loss" else name
        way = "improved" if sign > 0 else "risen"
        return (
            f"{what} has not {way} by more than {self.min_delta:g} for "
            f"{self.evals_without_improvement} evaluations (patience {self.patience}); the "
            f"best, {self.best_value:.4f}, was at step {self.best_step}"
        )
