"""A run plan: everything the one worker loop (`service.worker.loop.run_loop`) needs, typed,
whoever launched it. A fine-tuning job's driver makes it from the job's spec and its
prepared data (`service.control.driver.prepare_run`); `pstar train` from a spec file
(`service.worker.train_local.prepare_spec_run`), in this process or on Ray Train workers. The
defaults every launch shares are `service.spec.auto`'s (`checkpoint_every`, `eval_every`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.spec import auto

CHECKPOINTS_TO_KEEP = 3


class RunHyperparameters(BaseModel):
    """What the loop reads of the hyperparameters; a method's own (DPO's `beta`) and the
    job's others (its epochs and learning rate, for the record) come along."""

    model_config = ConfigDict(frozen=True, extra="allow")

    batch_size: int
    micro_batches: int = 1
    # steps between held-out evaluations; None: `auto.eval_every`; 0: only before the
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
    data_file: str  # the prepared rows (`service.data.rows`)
    export_dir: str | None = None  # where the trained model goes (Hugging Face files)
    tokenizer_dir: str | None = None  # a tokenizer the export carries (a zoo model's)
    resume_from: str | None = None  # the newest checkpoint an earlier attempt reported
    best_dir: str | None = None  # early stopping's best model
    early_stopping: dict[str, Any] | None = None
    storage_path: str | None = None  # Ray Train's storage (runs on Ray workers)
    # a reinforcement job whose graders ask models, or whose answers the model server
    # samples: the API they ask, and the file holding the attempt's key
    # (service.control.grader_access)
    grader_api_url: str | None = None
    grader_key_file: str | None = None
    embedding_model: str | None = None  # the model a `cosine` metric embeds with, by name
    # a reinforcement job sampling on the model server (`sampler: server`): where its
    # adapters go each step (service.methods.rollouts), and the job and attempt it is
    sampler_dir: str | None = None
    job_id: str | None = None
    attempt: int = 1

    @property
    def eval_every(self) -> int:
        return auto.eval_every(self.hyperparameters.eval_every, self.total_steps)

    @property
    def ref_file(self) -> Path:
        """Beside the rows: what a method computes once for them (DPO's reference)."""
        return Path(self.data_file).with_suffix(".ref.pt")
