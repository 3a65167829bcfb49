"""Hugging Face model directories in and out of the chunks, with bounded host memory.

In: the model is built from `config.json` on `meta`; the safetensors files (one, or the
shards named by `model.safetensors.index.json`) are read tensor by tensor (safetensors
maps the file, so only the tensor being copied is in memory) straight into the chunk
slots, converting dtype on the way. A tensor the model lacks, or a model tensor the
files lack, is an error that names it.

Out: `export_hf` writes config, safetensors shards and the source's tokenizer files so
that `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads the result. Shards
are sized like chunks and written one at a time, so memory stays bounded by one shard.

Both sides read and write the model through a `ChunkStore` (`store`), not the engine:
`model_on_meta` + `stream_weights` are what `initialize` does with a model directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from pstar_core import lora
from pstar_core.config import DTYPES, missing_unexpected
from pstar_core.store import ChunkStore

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# Files a fine-tuned directory should carry over from its source besides the weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


class HFLoadError(ValueError):
    """A model directory is missing, corrupt, or does not match its config."""


# [Note: one transformers load at a time] `from_pretrained` turns weight tying off for
# the load's duration by replacing `PreTrainedModel.tie_weights` on the class, and puts
# back what it found there (transformers' `initialization.no_tie_weights`; accelerate's
# `init_empty_weights`, which peft uses with low_cpu_mem_usage, patches `nn.Module` the
# same way). Two loads in
# one process at once can interleave so that the second puts back the first one's
# stand-in: from then on no model in the process ties its weights, and a tied model
# (GPT-2, SmolLM2) loads with a freshly initialized head, i.e. answers noise, with no error.
# A model built while another process-mate loads would come out untied the same way. So
# every load and build of a transformers model in the service, the engine and the tests
# takes this lock: `load_causal_lm`, or `with HF_LOADS:` around `from_config` and peft's
# loaders (scripts and benchmarks that load in a process of their own need not).
HF_LOADS = threading.RLock()  # re-entrant: a load inside a build in one thread waits for no one


def load_causal_lm(directory: str | Path, **kwargs) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(directory, **kwargs)`, one load at a time in
    this process ([Note: one transformers load at a time])."""
    from transformers import AutoModelForCausalLM

    with HF_LOADS:
        return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, in index order."""
    index = directory / SAFE_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFLoadError(f"{index} is corrupt: {e}") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise HFLoadError(f"{index} names shards that are missing: {missing}")
        return [directory / f for f in files]
    if (directory / SAFE_SINGLE).is_file():
        return [directory / SAFE_SINGLE]
    others = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (found {others}: convert them to safetensors first)" if others else ""
    raise HFLoadError(f"{directory}: no {SAFE_SINGLE} or {SAFE_INDEX}{hint}")


def model_on_meta(directory: Path) -> tuple[nn.Module, list[Path]]:
    """The causal LM of a model directory, built on `meta` from its `config.json`, and
    its weight files (for `stream_weights`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not is_hf_dir(directory):
        raise HFLoadError(f"{directory} is not a Hugging Face model directory (no config.json)")
    try:
        hf_config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, OSError) as e:
        raise HFLoadError(f"{directory}/config.json cannot be read: {e}") from None
    files = weight_files(directory)
    # import the model's module first, not under the meta device: some of what it imports
    # reads tensors as it loads (seen with torch 2.6 and transformers 5: "Tensor.item()
    # cannot be called on meta tensors", reported as "Could not import module ...")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with contextlib.suppress(KeyError):  # not a known causal LM: from_config says so
        MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    with torch.device("meta"), HF_LOADS:  # [Note: one transformers load at a time]
        module = AutoModelForCausalLM.from_config(hf_config)
    return module, files


def stream_weights(store: ChunkStore, files: list[Path]) -> None:
    """Copy every tensor of `files` into its slot (or buffer), one tensor at a time.

    For a LoRA model the files hold the base model: their names map to the base weights
    under the adapters, and the adapters themselves are not expected."""
    module = store.module
    own = module.state_dict(keep_vars=True)
    if lora.is_peft(module):
        by_file = {b: n for n in own if (b := lora.base_name(n)) is not None}
        module = module.get_base_model()
    else:
        by_file = {n: n for n in own}
    prefix = getattr(module, "base_model_prefix", "")
    ignorable = [
        re.compile(p) for p in getattr(module, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    name = by_file.get(key) or by_file.get(f"{prefix}.{key}" if prefix else key)
                    if name is None:
                        if not any(p.search(key) for p in ignorable):
                            unexpected.append(key)
                        continue
                    store.load_tensor(name, f.get_tensor(key), own[name])
                    loaded.add(name)
        except SafetensorError as e:
            raise HFLoadError(f"{path} is not a readable safetensors file: {e}") from None
    covered = set(loaded)
    for name in loaded:
        slot = store.by_name.get(name)
        if slot is not None:
            covered.update(slot.aliases)  # tied weights: one tensor in the file serves all names
    missing = [n for n in by_file.values() if n not in covered]
    if missing or unexpected:
        raise HFLoadError(
            "weights do not match the model config: " + missing_unexpected(missing, unexpected, 8)
        )


def export_hf(
    store: ChunkStore,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    variant: str | None = None,
) -> Path:
    """Write a directory that transformers (`variant` 'full' or 'merged') or peft
    ('adapter') loads, from the engine's fp32 masters. With ZeRO every rank takes part
    and rank 0 writes; the directory appears whole or not at all."""
    is_lora = lora.is_peft(store.module)
    variant = variant or ("adapter" if is_lora else "full")
    allowed = ("adapter", "merged") if is_lora else ("full",)
    if variant not in allowed:
        kind = "a LoRA model" if is_lora else "a model without adapters"
        raise ValueError(
            f"export variant {variant!r}: {kind} exports as {' or '.join(map(repr, allowed))}"
        )
    if variant == "adapter":
        return _export_adapter(store, out, dtype)
    module = store.module.get_base_model() if is_lora else store.module
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            f"export_hf needs a transformers model; {type(module).__name__} is not one "
            "(use save_checkpoint or state_dict instead)"
        )
    dtype = dtype or DTYPES[store.compute_dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    if max_shard_bytes is None:
        max_shard_bytes = max(store.chunk_size * esize, 64 * 2**20)
    names = _export_names(store)
    adapted = lora.layers(store.module) if is_lora else {}
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for out_name, name, numel in names:
        if shards[-1] and size + numel * esize > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((out_name, name))
        size += numel * esize

    def read(name: str) -> torch.Tensor:
        # always a host copy: a view of a chunk would be overwritten when reading the next
        # tensor brings a spilled chunk back in its place (disk tier, pinned pool), so a
        # shard holds copies, bounded by `max_shard_bytes`
        layer = adapted.get(name)
        if layer is not None:
            return lora.merged_weight(store, name, layer).to(dtype)  # a fresh tensor
        return store.read_tensor(name).to("cpu", dtype, copy=True).contiguous()

    with _staged(store, out) as tmp:
        if tmp is not None:
            saved_dtype = config.dtype
            config.dtype = dtype  # what from_pretrained(dtype="auto") will pick
            try:
                config.save_pretrained(str(tmp))
            finally:
                config.dtype = saved_dtype
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = (
                SAFE_SINGLE
                if len(shards) == 1
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            tensors = {out_name: read(name) for out_name, name in shard}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            if tmp is not None:
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
            weight_map.update(dict.fromkeys((o for o, _ in shard), fname))
        store.forget_gathered()
        if tmp is not None:
            if len(shards) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=1))
            _copy_side_files(store, tmp)
    return out.resolve()


def _export_adapter(store: ChunkStore, out: Path, dtype: torch.dtype | None) -> Path:
    """`adapter_config.json` + `adapter_model.safetensors`, as `peft` saves them (fp32
    masters unless `dtype` says otherwise; adapters are small)."""
    names = lora.adapter_names(store)
    tensors = {
        lora.adapter_file_name(n): store.read_tensor(n).to("cpu", dtype or torch.float32, copy=True)
        for n in names
    }
    store.forget_gathered()
    with _staged(store, out) as tmp:
        if tmp is not None:
            base = str(store.source_dir) if store.source_dir is not None else None
            lora.write_adapter_config(store.module, tmp, base)
            save_file(tensors, str(tmp / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
            _copy_side_files(store, tmp)
    return out.resolve()


@contextlib.contextmanager
def _staged(store: ChunkStore, out: Path) -> Iterator[Path | None]:
    """A temporary sibling of `out` that replaces it when the block ends well (rank 0; the
    other ranks get None and wait for it)."""
    out = out.resolve()
    writer = store.zero.rank == 0
    tmp = out.parent / f".{out.name}.tmp-export"
    if writer:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        yield tmp if writer else None
        if writer:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if store.zero.enabled:
        store.zero.barrier()


def _copy_side_files(store: ChunkStore, tmp: Path) -> None:
    if store.source_dir is not None:
        for side in SIDE_FILES:
            if (store.source_dir / side).is_file():
                shutil.copy2(store.source_dir / side, tmp / side)


def _export_names(store: ChunkStore) -> list[tuple[str, str, int]]:
    """(name in the export, engine name, elements) of each tensor to write: each tied
    tensor once, under its first name; for a LoRA model the base model's names, adapters
    left out (they are merged into their layers' weights)."""
    out: list[tuple[str, str, int]] = []
    written: set[int] = set()
    rename = lora.base_name if lora.is_peft(store.module) else (lambda n: n)
    for name, value in store.module.state_dict(keep_vars=True).items():
        slot = store.by_name.get(name)
        if slot is not None:
            if id(slot) in written:
                continue
            written.add(id(slot))
            name, numel = slot.name, slot.numel
        else:
            numel = value.numel()
        out_name = rename(name)
        if out_name is not None:
            out.append((out_name, name, numel))
    return out
