"""Engine checkpoints: every chunk of every list, plus the training state, in one directory.

Frozen weights (a LoRA model's base, or any frozen parameter) that still hold what the
engine's source model directory holds are not written: the checkpoint records that
directory, and loading leaves those chunks as the engine read them from it. A LoRA
checkpoint is then the adapters and their optimizer state only.

Layout of a checkpoint directory:
- `pstar_checkpoint.json`: format version, dtype, chunk size, world size, the tensor map
  (name, shape, chunk, offset), global step, lr scale, loss scaler;
- `rank{r}-of-{n}.safetensors`: the chunk payloads of that rank, keyed `{list}.{index}`:
  the fp32 masters, momentum and variance (and frozen chunks unless left to the source).
  The param chunks are not written: between steps each one is the cast of its master
  (Adam writes it so), so loading re-derives it, bitwise, in whatever compute dtype the
  loading engine resolved (a job resumed on a CPU without bf16 continues in fp32);
- `rank{r}-of-{n}.extra.pt`: RNG states, per-tensor step counts, and the excluded
  parameters' optimizer state.

[Note: streamed save] The rank file is written one chunk at a time: the safetensors
header (every entry's dtype, shape and byte range is known from the plan) goes first,
then each chunk is brought into memory (from disk if spilled), its bytes written, and it
is let go before the next. Nothing collects the payloads: with a disk tier a chunk
brought back may evict one written a moment ago, and a dict of views would then hold
memory the pinned pool has handed to another chunk. On a device, the bytes pass through
one host staging buffer of a chunk. So saving needs one chunk beyond the engine's own.

A checkpoint is written into a temporary sibling directory and renamed into place, so a
failure while saving leaves the previous checkpoint intact. Chunks are read back one at
a time, so loading needs no more host memory than one chunk beyond the engine's own.

What is saved comes through two protocols, never the engine itself: the chunks and the
tensors through its `ChunkStore` (`store`), and the rest as a `TrainingState` the engine
hands over and takes back (`Checkpointable`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from pstar_core.chunk import Chunk, ChunkType
from pstar_core.store import ChunkStore

FORMAT_VERSION = 2  # 2: no param chunks (re-derived from the masters)
READABLE_VERSIONS = (1, 2)
META = "pstar_checkpoint.json"
log = logging.getLogger(__name__)
# safetensors' names of the chunk dtypes
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class CheckpointError(RuntimeError):
    """The checkpoint is missing, corrupt, or was written for a different model/config."""


@dataclass
class TrainingState:
    """What a checkpoint keeps beside the chunks and the tensors' step counts."""

    global_step: int
    lr_scale: float  # the schedule's factor on every group's lr
    scaler: dict[str, Any]  # the loss scaler's state
    rng: Any  # the CPU's and this rank's device's RNG states (`devices.rng_state`)
    excluded: dict[str, Any]  # the excluded parameters' values and optimizer state
    # where Adam ran for each chunk (`ChunkManager.placement_state`); None in checkpoints
    # written before it was kept
    placement: dict[str, Any] | None


class Checkpointable(Protocol):
    """What saves and restores a checkpoint: an `Engine`."""

    @property
    def tensors(self) -> ChunkStore:
        """The chunks and the tensors."""

    def training_state(self) -> TrainingState:
        """The state beside the chunks, now."""

    def load_training_state(self, state: TrainingState) -> None:
        """Continue from `state` (the chunks are loaded already)."""

    def load_excluded_weights(self, excluded: dict[str, Any]) -> None:
        """The weights kept out of chunks, from a state's `excluded`, without their
        optimizer state."""


def _rank_file(rank: int, world: int, suffix: str) -> str:
    return f"rank{rank}-of-{world}{suffix}"


def _meta(store: ChunkStore, state: TrainingState | None = None) -> dict[str, Any]:
    """The metadata file's contents; without `state`, the layout only (what a checkpoint
    must match to load)."""
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": store.compute_dtype,
        "chunk_size": store.chunk_size,
        "world_size": store.zero.nproc,
        "lists": {k.value: len(v) for k, v in store.lists.items()},
        "tensors": [
            {
                "name": s.name,
                "shape": list(s.shape),
                "chunk": s.chunk_index,
                "offset": s.offset,
                "trainable": s.trainable,
            }
            for s in store.slots
        ],
        "frozen": "source" if store.frozen_from_source else "saved",
        "source_dir": str(store.source_dir) if store.source_dir is not None else None,
    }
    if state is not None:
        meta["global_step"] = state.global_step
        meta["lr_scale"] = state.lr_scale
        meta["scaler"] = state.scaler
    return meta


def save_checkpoint(engine: Checkpointable, directory: Path, shared: bool = True) -> Path:
    """Every rank writes its own shard; rank 0 writes the metadata.

    `shared=True`: all ranks see `directory` (one filesystem); the checkpoint is built in
    a temporary sibling and renamed into place once every rank has written, so an old
    checkpoint survives a failure. `shared=False`: each rank writes its files straight
    into its own (fresh) `directory`, for frameworks that collect per-rank directories
    (Ray Train); file names never collide across ranks.
    """
    store, state = engine.tensors, engine.training_state()
    zero = store.zero
    directory = directory.resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    if not shared:
        directory.mkdir(parents=True, exist_ok=True)
        _write_rank_files(store, state, directory)
        return directory
    tmp = directory.parent / f".{directory.name}.tmp"
    if zero.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(zero)
    try:
        _write_rank_files(store, state, tmp)
        _barrier(zero)
        if zero.rank == 0:
            _replace_dir(tmp, directory)
    except BaseException:
        if zero.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(zero)
    return directory


def _barrier(zero) -> None:
    if zero.enabled:
        zero.barrier()


def _write_rank_files(store: ChunkStore, state: TrainingState, directory: Path) -> None:
    zero = store.zero
    chunks = _saved_chunks(store, not store.frozen_from_source)
    write_streamed(
        directory / _rank_file(zero.rank, zero.nproc, ".safetensors"),
        [(f"{c.kind.value}.{c.index}", c) for c in chunks],
        lambda c: None if c.zero_pending else store.in_memory(c).payload,
    )
    extra = {
        "rng": state.rng,  # the CPU's and this rank's device's, not all GPUs'
        "excluded": state.excluded,
        "steps": [s.step for s in store.slots],
        # where Adam ran for each chunk (see `placement.saved`)
        "placement": state.placement,
    }
    torch.save(extra, directory / _rank_file(zero.rank, zero.nproc, ".extra.pt"))
    if zero.rank == 0:
        (directory / META).write_text(json.dumps(_meta(store, state), indent=1))


def write_streamed(path: Path, entries: list[tuple[str, Chunk]], payload_of) -> None:
    """A safetensors file of whole chunks, written one chunk at a time (see [Note:
    streamed save]); `payload_of(chunk)` makes the chunk's payload readable, or returns
    None for a chunk that is all zeros and has no memory yet (Adam state before step 1)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, c in entries:
        header[key] = {
            "dtype": _ST_DTYPES[c.dtype],
            "shape": [c.capacity],
            "data_offsets": [offset, offset + c.nbytes],
        }
        offset += c.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    staging: torch.Tensor | None = None  # one chunk's host bytes, for device payloads
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _key, c in entries:
            payload = payload_of(c)
            if payload is None:
                _write_zeros(f, c.nbytes)
                continue
            if payload.device.type != "cpu":
                if staging is None or staging.numel() < c.nbytes:
                    staging = torch.empty(c.nbytes, dtype=torch.uint8)
                host = staging[: c.nbytes]
                host.copy_(payload.view(torch.uint8))
            else:
                host = payload.view(torch.uint8)
            f.write(memoryview(host.numpy()))
            del payload, host


def _write_zeros(f: Any, nbytes: int, block: int = 2**20) -> None:
    zeros = bytes(min(block, nbytes))
    while nbytes > 0:
        n = min(block, nbytes)
        f.write(zeros[:n])
        nbytes -= n


def _saved_chunks(store: ChunkStore, frozen_saved: bool) -> list[Any]:
    """This rank's chunks that a checkpoint holds: the optimizer lists, and the frozen
    list unless its source directory holds it (param chunks are re-derived)."""
    return [
        c
        for c in store.own_chunks()
        if c.kind is not ChunkType.PARAM and (frozen_saved or c.kind is not ChunkType.FROZEN)
    ]


def _replace_dir(new: Path, target: Path) -> None:
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(engine: Checkpointable, directory: Path, optimizer: bool = True) -> None:
    """Load the chunks into the engine's store, then hand it the training state (without
    `optimizer`: the weights alone, the fp32 masters and the frozen chunks)."""
    store = engine.tensors
    meta_path = directory / META
    if not meta_path.is_file():
        raise CheckpointError(f"{directory} is not a pstar checkpoint (no {META})")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt: {e}") from None
    _check_compatible(store, meta, directory)
    zero = store.zero
    frozen_saved = meta.get("frozen", "saved") == "saved"
    if meta["dtype"] != store.compute_dtype:
        log.info(
            "checkpoint %s was written in %s; this engine computes in %s (param chunks are "
            "re-derived from the fp32 masters)",
            directory,
            meta["dtype"],
            store.compute_dtype,
        )
    path = directory / _rank_file(zero.rank, zero.nproc, ".safetensors")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for c in _saved_chunks(store, frozen_saved):
                if not optimizer and c.kind in (ChunkType.MOMENTUM, ChunkType.VARIANCE):
                    continue
                key = f"{c.kind.value}.{c.index}"
                # copy_ casts: frozen chunks saved in another compute dtype
                store.in_memory(c).payload.copy_(f.get_tensor(key))
    except (OSError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"cannot read chunk data from {path}: {e}") from None
    for param in store.own_chunks([ChunkType.PARAM]):
        master = store.lists[ChunkType.PARAM_FP32][param.index]
        store.colocate([param, master])
        param.payload.copy_(master.payload)  # what Adam wrote there: the cast of the master
    extra_path = directory / _rank_file(zero.rank, zero.nproc, ".extra.pt")
    try:
        extra = torch.load(
            extra_path,
            weights_only=True,  # tensors and plain containers only: a file is data, never code
            map_location="cpu",  # written on whatever device; placed by the engine
        )
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"cannot read {extra_path}: {e}".splitlines()[0]
            + " (a checkpoint holds tensors and plain values only; this file is damaged or "
            "was not written by this engine)"
        ) from None
    if frozen_saved:
        store.frozen_from_source = False
    if not optimizer:
        engine.load_excluded_weights(extra["excluded"])
        return
    for slot, step in zip(store.slots, extra["steps"], strict=True):
        slot.step = int(step)
    engine.load_training_state(
        TrainingState(
            global_step=int(meta["global_step"]),
            lr_scale=float(meta["lr_scale"]),
            scaler=meta["scaler"],
            rng=extra["rng"],
            excluded=extra["excluded"],
            placement=extra.get("placement"),
        )
    )


def _check_compatible(store: ChunkStore, meta: dict[str, Any], directory: Path) -> None:
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{directory}: format version {meta.get('format_version')}, "
            f"this engine reads {list(READABLE_VERSIONS)}"
        )
    ours = _meta(store)
    if meta.get("frozen") == "source" and not store.frozen_from_source:
        raise CheckpointError(
            f"{directory}: the checkpoint leaves its frozen weights to the model directory "
            f"{meta.get('source_dir')}; initialize the engine from that directory first"
        )
    # the compute dtype may differ: the layout does not depend on it (see the module note)
    for key in ("chunk_size", "world_size", "lists"):
        if meta.get(key) != ours[key]:
            raise CheckpointError(
                f"{directory}: checkpoint has {key}={meta.get(key)}, this engine {ours[key]}; "
                "load it with the same model and engine config"
            )
    for theirs, mine in zip(meta["tensors"], ours["tensors"], strict=False):
        layout = ("name", "shape", "chunk", "offset", "trainable")
        if any(theirs[k] != mine[k] for k in layout):
            raise CheckpointError(
                f"{directory}: tensor {theirs['name']} {theirs['shape']} does not match "
                f"{mine['name']} {mine['shape']} of this model"
            )
    if len(meta["tensors"]) != len(ours["tensors"]):
        raise CheckpointError(
            f"{directory}: {len(meta['tensors'])} tensors in the checkpoint, "
            f"{len(ours['tensors'])} in this model"
        )
