"""A run plan for tests that need one and set only what they read."""

from __future__ import annotations

from typing import Any

from service.spec.run_plan import RunHyperparameters, RunPlan


def run_plan(**fields: Any) -> RunPlan:
    given: dict[str, Any] = {
        "model": {},
        "method": "supervised",
        "hyperparameters": RunHyperparameters(batch_size=1),
        "engine": {},
        "seq_len": 16,
        "total_steps": 4,
        "steps_per_epoch": 1,
        "checkpoint_every": 1,
        "data_file": "rows.pt",
    }
    return RunPlan(**{**given, **fields})
