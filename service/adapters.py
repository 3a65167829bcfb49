"""LoRA jobs in the service: which models take adapters, the check of `target_modules`
against the model (on the meta device, before anything is stored), and where a LoRA job's
adapters and merged model are written.

Layout of a LoRA job's output (the engine writes both forms, see `Engine.export_hf`):
- `Settings.finetuned_dir(job)/`: the merged model, a plain transformers directory like
  every fine-tuned model's, so whatever loads or fine-tunes a fine-tuned model (another
  job, `from_pretrained`) takes it as it is;
- `Settings.finetuned_dir(job)/adapter/`: the PEFT adapter (`adapter_config.json`,
  `adapter_model.safetensors`, the tokenizer) that `PeftModel.from_pretrained` loads onto
  the job's model;
- `<checkpoint dir>/adapter/`: the same adapter form of every checkpoint, written by
  rank 0 beside the engine's chunks, so each checkpoint downloads as an adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pstar_core.config import ConfigError, LoraConfig
from service.errors import InvalidRequest

ADAPTER_DIR = "adapter"  # the adapter beside a merged export, and inside a checkpoint
PARAM = "method.lora.target_modules"


def adapter_dir(directory: str | Path) -> Path:
    """Where the adapter of an export or checkpoint directory is."""
    return Path(directory) / ADAPTER_DIR


def wrap_meta(module: Any, settings: dict[str, Any]) -> Any:
    """The model (built on meta) with the job's adapters, still on meta, as the engine
    builds it; `InvalidRequest` naming `method.lora.target_modules` if they do not fit."""
    from pstar_core import lora

    linear = ", ".join(linear_names(module)) or "none"  # before peft changes the model

    def refuse(why: str) -> InvalidRequest:
        return InvalidRequest(
            f"{PARAM}: {why} (the model's linear layers: {linear})",
            param=PARAM,
            code="invalid_value",
        )

    # the engine refuses names that match nothing and adapters on non-linear layers
    try:
        return lora.wrap(module, LoraConfig.model_validate(settings))
    except ConfigError as e:
        raise refuse(str(e).removeprefix("lora.target_modules: ")) from None


def linear_names(module: Any) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules names)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in module.named_modules() if name and is_linear(m)}
    )


def is_linear(module: Any) -> bool:
    """A layer the engine trains adapters of: torch's Linear, or GPT-2's Conv1D (a linear
    layer with its weight transposed)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))
