"""Compute kernels of the pstar_core engine (currently: the chunk AdamW step)."""

from __future__ import annotations

from pstar_core.kernels.adam import AdamSegment, adamw_, grad_sq_norm, kernel_backend

__all__ = ["AdamSegment", "adamw_", "grad_sq_norm", "kernel_backend"]
