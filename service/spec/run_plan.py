"""A run plan: everything the one worker loop (`service.worker.loop.run_loop`) needs, typed,
whoever launched it. A fine-tuning job's driver makes it from the job's spec and its
prepared data (`service.control.driver.prepare_run`); `pstar train` from a spec file
(`service.worker.train_local.prepare_spec_run`), in this process or on Ray Train workers. The
defaults every launch shares are here, once (`checkpoint_every`, `eval_every`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

CHECKPOINTS_TO_KEEP = 3


class RunHyperparameters(BaseModel):
    """What the loop reads of the hyperparameters; a method's own (DPO's `beta`) and the
    job's others (its epochs and learning rate, for the record) come along."""

    model_config = ConfigDict(frozen=True, extra="allow")

    batch_size: int
    micro_batches: int = 1
    # steps between held-out evaluations; None: `default_eval_every`; 0: only before the
    # first step and after the last
    eval_every: int | None = None


class RunPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # how to build the model (`service.data.prepare.model_fn`): {"id", "kind", "path"} of a
    # job's model, or {"spec", "vocab_size"} of a `pstar train` zoo model
    model: dict[str, Any]
    method: str  # the training method (`service.methods`), by name
    lora: bool = False  # it trains LoRA adapters (checkpoints and exports carry them)
    hyperparameters: RunHyperparameters
    engine: dict[str, Any]  # the engine's config
    seq_len: int
    vocab_size: int = 0
    total_steps: int
    steps_per_epoch: int
    checkpoint_every: int  # 0: at the end only
    checkpoints_to_keep: int = CHECKPOINTS_TO_KEEP
    seed: int = 0
    data_file: str  # the prepared rows (`service.data.prepare.save_rows`)
    export_dir: str | None = None  # where the trained model goes (Hugging Face files)
    tokenizer_dir: str | None = None  # a tokenizer the export carries (a zoo model's)
    resume_from: str | None = None  # the newest checkpoint an earlier attempt reported
    best_dir: str | None = None  # early stopping's best model
    early_stopping: dict[str, Any] | None = None
    storage_path: str | None = None  # Ray Train's storage (runs on Ray workers)

    @property
    def eval_every(self) -> int:
        return default_eval_every(self.hyperparameters.eval_every, self.total_steps)

    @property
    def ref_file(self) -> Path:
        """Beside the rows: what a method computes once for them (DPO's reference)."""
        return Path(self.data_file).with_suffix(".ref.pt")


def default_checkpoint_every(given: int | None, total_steps: int, restartable: bool) -> int:
    """Steps between checkpoints: as given, else every quarter of the run where something
    restarts a lost worker (a job, or Ray Train workers) and only at the end where nothing
    does (`pstar train` in one process: a rerun resumes from that)."""
    if given:
        return given
    return max(1, -(-total_steps // 4)) if restartable else 0


def default_eval_every(given: int | None, total_steps: int) -> int:
    """Steps between held-out evaluations: as given (0: only before and after), else ten
    in a run."""
    return given if given is not None else max(1, total_steps // 10)
