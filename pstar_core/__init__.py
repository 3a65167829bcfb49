"""pstar_core: the PatrickStar chunk engine. Depends on torch only.

`initialize(model_fn, config) -> Engine` is the entry point; see `pstar_core.engine`.
"""

from __future__ import annotations

from pstar_core.chunk import ChunkType, IllegalTransition, TensorState
from pstar_core.config import ConfigError, EngineConfig
from pstar_core.engine import Engine, initialize
from pstar_core.optim import StepHyper

__all__ = [
    "ChunkType",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "IllegalTransition",
    "StepHyper",
    "TensorState",
    "initialize",
]
