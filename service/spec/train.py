"""`TrainSpec`: what a fine-tuning job is, as a user writes it in YAML.

The engine section is passed through to `pstar_core.EngineConfig` and validated there;
relative paths in a spec are resolved against the spec file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pstar_core.config import ConfigError, EngineConfig


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataSpec(_Spec):
    path: Path = Field(description="a UTF-8 text file to train on")
    seq_len: int = Field(default=128, ge=8, description="tokens per training sequence")
    vocab_size: int = Field(
        default=4096, ge=260, description="BPE vocabulary trained on the text (zoo models)"
    )
    heldout_fraction: float = Field(default=0.02, gt=0, lt=0.5)
    max_chars: int | None = Field(default=None, gt=0, description="use only the first N chars")


class TrainLoopSpec(_Spec):
    steps: int = Field(default=100, gt=0)
    batch_size: int = Field(default=8, gt=0, description="sequences per optimizer step")
    micro_batches: int = Field(default=1, gt=0, description="gradient accumulation steps")
    eval_batches: int = Field(default=8, gt=0, description="held-out batches for perplexity")
    eval_every: int | None = Field(
        default=None, gt=0, description="held-out loss every N steps (default: before and after)"
    )
    log_every: int = Field(default=10, gt=0)
    checkpoint_every: int | None = Field(
        default=None,
        gt=0,
        description="checkpoint every N steps (default: at the end in one process; every "
        "quarter of the run on Ray workers, which a restarted worker group resumes from)",
    )
    seed: int = 0


class TrainSpec(_Spec):
    name: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    model: str = Field(
        description="a zoo name (see `pstar models`) or a Hugging Face model directory"
    )
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    data: DataSpec
    train: TrainLoopSpec = TrainLoopSpec()
    engine: dict[str, Any] = Field(default_factory=dict)
    output_dir: Path = Path("runs")

    def engine_config(self) -> EngineConfig:
        return EngineConfig.parse(self.engine)

    @classmethod
    def load(cls, path: str | Path) -> TrainSpec:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"spec file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"spec file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"spec file {path} must hold a mapping")
        try:
            spec = cls.model_validate(raw)
        except ValidationError as e:
            lines = [
                f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})"
                for err in e.errors()
            ]
            raise ConfigError(f"invalid spec {path}:\n  " + "\n  ".join(lines)) from None
        spec.engine_config()  # fail now, not after the data is prepared
        base = path.resolve().parent
        data = spec.data.model_copy(update={"path": _resolve(base, spec.data.path)})
        update = {"data": data, "output_dir": _resolve(base, spec.output_dir)}
        if spec.is_path_model:
            update["model"] = str(_resolve(base, Path(spec.model)))
        return spec.model_copy(update=update)

    @property
    def is_path_model(self) -> bool:
        """A model given as a directory (anything with a path separator), not a zoo name."""
        return "/" in self.model or self.model.startswith(".")


def _resolve(base: Path, p: Path) -> Path:
    return p if p.is_absolute() else (base / p).resolve()
