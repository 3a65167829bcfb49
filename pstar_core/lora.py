"""LoRA in the chunk engine: `peft` writes the adapters, the engine trains them.

`wrap` turns a model built on `meta` into a `peft` model (still on `meta`), so the engine
sees frozen base weights (they go to the frozen, param-only chunk list) and trainable
adapter weights (the chunk lists with fp32 masters and Adam state), like any model.
Nothing else in the engine knows about LoRA; this module translates names between the
three worlds and writes the two export forms:

- the base model's own names (`model.layers.0.self_attn.q_proj.weight`), used by the
  model directory the base streams from and by a merged export;
- the engine's names, those of the `peft` model
  (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`,
  `...q_proj.lora_A.default.weight`);
- the adapter file's names, as `peft` saves them (`...q_proj.lora_A.weight`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pstar_core.config import ConfigError, LoraConfig, missing_unexpected
from pstar_core.store import ChunkStore

ADAPTER = "default"  # peft's name of the one adapter the engine trains
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ADAPTER_PARAM = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.weight$")


class AdapterError(ValueError):
    """An adapter directory is missing, corrupt, or does not fit the model."""


def is_peft(module: nn.Module) -> bool:
    # a model can only be a peft model if peft is imported already: importing it here
    # would pull in transformers, accelerate and sympy (~130 MB, ~3 s) for any model
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def peft_config(cfg: LoraConfig) -> Any:
    """The `peft.LoraConfig` for the engine's `lora` section (or its adapter directory)."""
    import peft

    if cfg.adapter_dir is None:
        return peft.LoraConfig(
            r=cfg.r,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=(
                cfg.target_modules
                if isinstance(cfg.target_modules, str)
                else list(cfg.target_modules)
            ),
            bias="none",
        )
    path = cfg.adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(
            f"lora.adapter_dir: {cfg.adapter_dir} is not a PEFT adapter directory "
            f"(no {ADAPTER_CONFIG})"
        )
    try:
        theirs = peft.LoraConfig.from_pretrained(str(cfg.adapter_dir))
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} cannot be read as a LoRA config: {e}") from None
    given = {
        "r": (cfg.r, theirs.r),
        "alpha": (cfg.alpha, theirs.lora_alpha),
        "dropout": (cfg.dropout, theirs.lora_dropout),
    }
    for field in cfg.model_fields_set & set(given):
        ours, adapter = given[field]
        if float(ours) != float(adapter):
            raise ConfigError(
                f"lora.{field} is {ours} but the adapter in {cfg.adapter_dir} was trained with "
                f"{adapter}; drop lora.{field} (the adapter's value applies) or start a new one"
            )
    if theirs.bias != "none" or getattr(theirs, "use_dora", False) or theirs.modules_to_save:
        raise AdapterError(
            f"{path}: only plain LoRA adapters continue here (bias 'none', no DoRA, no "
            "modules_to_save)"
        )
    theirs.inference_mode = False
    return theirs


def wrap(module: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`module` (built on meta) with LoRA adapters on its target modules, still on meta."""
    import peft

    config = peft_config(cfg)
    asked = None if isinstance(config.target_modules, str) else set(config.target_modules)
    with torch.device("meta"):
        try:
            wrapped = peft.get_peft_model(module, config)
        except ValueError as e:  # e.g. no module matches the targets
            raise ConfigError(f"lora.target_modules: {e}") from None
    adapted = {name: mod for name, mod in wrapped.named_modules() if _is_lora_layer(mod)}
    if asked is not None:
        # peft refuses a list only when no name matches: a typo beside a good name
        # would train silently without its adapters
        unmatched = sorted(t for t in asked if not any(_matches(n, t) for n in adapted))
        if unmatched:
            raise ConfigError(
                f"lora.target_modules: {unmatched} match no module of the model; name "
                "modules (or name suffixes) of its linear layers, or use 'all-linear'"
            )
    from peft.tuners.lora import Linear

    other = sorted(
        n.removeprefix(_PEFT_PREFIX) for n, m in adapted.items() if not isinstance(m, Linear)
    )
    if other:
        raise ConfigError(
            f"lora.target_modules: {other[:4]} are not linear layers (embeddings, "
            "convolutions); the engine trains adapters on linear layers only"
        )
    return wrapped


def _is_lora_layer(mod: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(mod, LoraLayer)


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


def init_adapters(module: nn.Module) -> None:
    """peft's own adapter init, run on the materialized slots (by default A Kaiming
    uniform and B zeros, so training starts at the base model; a model built with
    `init_lora_weights=False` keeps the random values its init code gave both)."""
    from peft.tuners.lora import LoraLayer

    how = module.peft_config[ADAPTER].init_lora_weights
    for mod in module.modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            mod.reset_lora_parameters(ADAPTER, how)


def base_name(name: str) -> str | None:
    """The base model's name of an engine name; None for an adapter weight."""
    if "lora_" in name:
        return None
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def adapter_file_name(name: str) -> str:
    """The name `peft` saves an adapter weight under (the adapter's name left out)."""
    return _ADAPTER_PARAM.sub(r".\1.weight", name)


def adapter_names(store: ChunkStore) -> list[str]:
    return [s.name for s in store.slots if _ADAPTER_PARAM.search(s.name)]


def load_adapter(store: ChunkStore, directory: Path) -> None:
    """Copy the adapter weights of a PEFT directory into their slots; every adapter of the
    model must be in the file and nothing else."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{directory}: no {ADAPTER_WEIGHTS} (only safetensors adapters load)")
    own = store.module.state_dict(keep_vars=True)
    wanted = {adapter_file_name(n): n for n in adapter_names(store)}
    seen: set[str] = set()
    unexpected: list[str] = []
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = wanted.get(key)
                if name is None:
                    unexpected.append(key)
                    continue
                store.load_tensor(name, f.get_tensor(key), own[name])
                seen.add(key)
    except SafetensorError as e:
        raise AdapterError(f"{path} is not a readable safetensors file: {e}") from None
    missing = sorted(set(wanted) - seen)
    if missing or unexpected:
        raise AdapterError(
            f"{path} does not fit the model: " + missing_unexpected(missing, unexpected, 6)
        )


def layers(module: nn.Module) -> dict[str, Any]:
    """The LoRA layers by the engine name of their base weight."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for prefix, mod in module.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            out[f"{prefix}.base_layer.weight"] = mod
    return out


def merged_weight(store: ChunkStore, weight_name: str, layer: Any) -> torch.Tensor:
    """W + (alpha / r) B A for one adapted layer, in fp32 on the host, as peft merges."""
    w = store.read_tensor(weight_name).to("cpu", torch.float32, copy=True)
    prefix = weight_name[: -len("base_layer.weight")]
    # copies: reading the next tensor may evict this one's chunk (see hf.export_hf)
    a = store.read_tensor(f"{prefix}lora_A.{ADAPTER}.weight").to("cpu", torch.float32, copy=True)
    b = store.read_tensor(f"{prefix}lora_B.{ADAPTER}.weight").to("cpu", torch.float32, copy=True)
    delta = (b @ a) * layer.scaling[ADAPTER]
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return w.add_(delta)


def write_adapter_config(module: nn.Module, directory: Path, base: str | None) -> None:
    config = module.peft_config[ADAPTER]
    config.base_model_name_or_path = base
    config.inference_mode = True
    try:
        config.save_pretrained(str(directory))
    finally:
        config.inference_mode = False
