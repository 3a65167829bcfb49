"""GPT model family: the model definition (`gpt`) and the named configuration registry (`zoo`)."""

from __future__ import annotations

from pstar_core.models.gpt import GPT, CausalLMOutput, GPTConfig, flops_per_token, num_params
from pstar_core.models.zoo import ZOO, build, format_table, get_config, list_models

__all__ = [
    "GPT",
    "ZOO",
    "CausalLMOutput",
    "GPTConfig",
    "build",
    "flops_per_token",
    "format_table",
    "get_config",
    "list_models",
    "num_params",
]
