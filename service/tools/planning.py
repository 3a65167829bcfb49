"""`pstar plan`: the chunk plan of a zoo model or a Hugging Face config, on `meta`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pstar_core.mapping import make_plan
from pstar_core.precision import planned_dtype


def build_meta(model: str) -> nn.Module:
    """A zoo name, a HF config.json, or a HF model directory, built on the meta device."""
    path = Path(model)
    if path.exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
        from pstar_core.hf import HF_LOADS

        with HF_LOADS, torch.device("meta"):  # [Note: one transformers load at a time]
            return AutoModelForCausalLM.from_config(cfg)
    from pstar_core.models import GPT, get_config

    with torch.device("meta"):
        return GPT(get_config(model))


def plan_model(
    model: str, dtype: str = "auto", chunk_size: str | int = "auto", nproc: int = 1
) -> dict[str, Any]:
    t0 = time.perf_counter()
    dtype = planned_dtype(dtype, accelerator=False)
    module = build_meta(model)
    seen: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in module.named_parameters():
        seen.setdefault(id(p), (name, p))
    params = list(seen.values())
    size: str | int = chunk_size if chunk_size == "auto" else int(chunk_size)
    plan = make_plan(
        [p.numel() for _, p in params],
        [p.requires_grad for _, p in params],
        [n for n, _ in params],
        dtype,
        size,
        nproc,
    )
    return {
        "model": model,
        "dtype": dtype,
        "nproc": nproc,
        "chunk_size": plan.chunk_size,
        "utilization": plan.utilization,
        "params": plan.params,
        "trainable_params": plan.trainable_params,
        "model_data_bytes": plan.model_data_bytes,
        "chunk_bytes": plan.chunk_bytes,
        "lists": plan.list_stats(),
        "per_rank": plan.per_rank(nproc),
        # tensors larger than a chunk, each with the chunks it spans
        "spanning": [{"tensor": name, "chunks": n} for name, n in plan.spanning],
        "plan_s": time.perf_counter() - t0,
    }
