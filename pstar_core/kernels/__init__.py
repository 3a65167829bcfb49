"""Compute kernels of the pstar_core engine (currently: the chunk AdamW step)."""

from __future__ import annotations

from pstar_core.kernels.adam import (
    AdamSegment,
    adam_temporary_bytes,
    adamw_,
    grad_sq_norm,
    grad_sq_norm_device,
    kernel_backend,
)

__all__ = [
    "AdamSegment",
    "adam_temporary_bytes",
    "adamw_",
    "grad_sq_norm",
    "grad_sq_norm_device",
    "kernel_backend",
]
