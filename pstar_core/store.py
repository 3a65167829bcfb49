"""`ChunkStore`: the model's tensors and this rank's chunks, as the I/O modules see them.

Checkpoints (`checkpoint`), Hugging Face load and export (`hf`) and LoRA adapter files
(`lora`) read and write model data through this protocol and nothing else: they never
see the engine, its optimizer or its hooks, so they change only when a file format
does. An engine's `tensors` (`tensors.ModelTensors`) is the one implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from pstar_core.chunk import Chunk, ChunkType, TensorSlot
from pstar_core.spans import Span
from pstar_core.zero import ZeroGroup


class ChunkStore(Protocol):
    """The model's state-dict entries by name, and the chunks this rank keeps."""

    # -- tensors by name ------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The model, whose `state_dict` names every entry."""

    @property
    def by_name(self) -> Mapping[str, TensorSlot | Span]:
        """The chunked tensors under every name of theirs (tied weights have several); a
        parameter larger than a chunk as its `Span`."""

    def read_tensor(self, name: str) -> torch.Tensor:
        """One state-dict entry: the fp32 master of a trainable parameter. Under ZeRO
        every rank asks for the same names in the same order (its owner broadcasts it)."""

    def load_tensor(self, name: str, value: torch.Tensor, own: torch.Tensor) -> None:
        """Write one state-dict entry (any dtype) into its slot; `own` is the model's
        entry, for one outside the chunks."""

    def forget_gathered(self) -> None:
        """Drop the chunk `read_tensor` keeps from another rank."""

    # -- this rank's chunks ---------------------------------------------------------------

    @property
    def compute_dtype(self) -> str:
        """What the param and frozen chunks hold: 'fp32', 'bf16' or 'fp16'."""

    @property
    def chunk_size(self) -> int:
        """Elements per chunk."""

    @property
    def lists(self) -> Mapping[ChunkType, Sequence[Chunk]]:
        """The chunk lists, every rank's chunks in them (the others' without memory)."""

    @property
    def slots(self) -> Sequence[TensorSlot]:
        """Every chunked tensor, in the order of the chunk layout."""

    def own_chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        """The chunks this rank keeps, of `kinds` (all lists by default)."""

    def in_memory(self, chunk: Chunk) -> Chunk:
        """`chunk`, with a payload (brought back from disk, or allocated as zeros)."""

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        """Bring `chunks` into memory together, on the first one's tier."""

    # -- the ranks sharing the chunks -----------------------------------------------------

    @property
    def zero(self) -> ZeroGroup:
        """This rank's place among them (one rank: `ZeroGroup.single()`)."""

    # -- where the weights came from ------------------------------------------------------

    source_dir: Path | None  # the Hugging Face model directory they streamed from
    # the frozen chunks hold exactly what `source_dir` holds (a checkpoint leaves them out)
    frozen_from_source: bool


__all__ = ["ChunkStore"]
