"""Tokenized examples, compact and streamed: what data preparation holds between reading a
file and writing its rows (`service.data.rows`).

As Python lists, a token costs about 36 bytes (a pointer and an int object) and its loss
mask 8 more, and a file's parsed JSON lines several times the file: preparing a 64 MiB
chat file that way held 1.4 GiB. Here each example is tokenized as its line is read, and
its ids (int32) and loss mask (a byte each) are appended end to end to two flat buffers:
files in the job's preparation directory (read back through a memory map), or memory for
small inputs. Per example, memory holds its offset and where its loss starts (12 bytes),
whatever its length.

Entries per format: chat and completion examples one each (ids, loss mask); preference
pairs two, the preferred answer's then the other's (`service.data.preference`); text
documents one each, with their EOS and no mask (their rows are cuts of the documents end
to end, every token trained on).
"""

from __future__ import annotations

import io
import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from service.data.datasets import ensure_chat_template, example_tokens, pair_tokens

ID = np.int32
FLUSH_TOKENS = 1 << 20  # tokens buffered before they are written out
TEXT_BATCH = 512  # documents tokenized by one call (the fast tokenizer batches in Rust)


@dataclass
class Tokens:
    """Every example's tokens, uncut, end to end."""

    ids: np.ndarray  # int32
    mask: np.ndarray | None  # uint8, 1 where the loss is taken; None: text, every token
    starts: np.ndarray  # int64, len(self) + 1: example k is ids[starts[k]:starts[k + 1]]
    first_loss: np.ndarray  # int32: an example's first position >= 1 trained on, or its length

    @classmethod
    def of(cls, examples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Tokens:
        """From (ids, loss mask) pairs in memory (tests, small inputs)."""
        w = TokenWriter()
        for ids, mask in examples:
            w.add(ids, mask)
        return w.finish()

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if len(self) else 0

    def cut(self, seq_len: int) -> np.ndarray:
        """Each example's tokens within a row of `seq_len` (longer ones are truncated)."""
        return np.minimum(self.lengths, seq_len)

    def kept(self, seq_len: int) -> np.ndarray:
        """Whether each example keeps a token to train on once cut to `seq_len` (the first
        position predicts nothing: labels shift by one inside the model)."""
        return self.first_loss < self.cut(seq_len)

    def example(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `n` ids of example `k` and their loss mask."""
        a = int(self.starts[k])
        ids = self.ids[a : a + n]
        return ids, self.mask[a : a + n] if self.mask is not None else np.ones(n, np.uint8)


def as_tokens(tokens: Tokens | Iterable[tuple[Sequence[int], Sequence[int]]]) -> Tokens:
    return tokens if isinstance(tokens, Tokens) else Tokens.of(tokens)


class TokenWriter:
    """Appends examples' tokens to `dir`'s `ids.bin` and `mask.bin` (or to memory when
    `dir` is None) in blocks of `FLUSH_TOKENS`; `finish` maps them back as `Tokens`."""

    def __init__(self, dir: Path | None = None, masked: bool = True) -> None:
        self.dir = dir
        if dir is not None:
            dir.mkdir(parents=True, exist_ok=True)
            self._ids_out: BinaryIO = (dir / "ids.bin").open("wb")
            self._mask_out: BinaryIO | None = (dir / "mask.bin").open("wb") if masked else None
        else:
            self._ids_out, self._mask_out = io.BytesIO(), io.BytesIO() if masked else None
        self._ids, self._mask = array("i"), array("B")
        self._starts, self._first = array("q", [0]), array("i")

    def add(self, ids: Sequence[int], mask: Sequence[int] | None = None) -> None:
        n = len(ids)
        self._ids.extend(ids)
        if self._mask_out is not None:
            if mask is None or len(mask) != n:
                raise ValueError(f"a loss mask of {n} entries is needed, got {mask!r:.40}")
            self._mask.extend(mask)
            self._first.append(next((k for k in range(1, n) if mask[k]), n))
        else:
            self._first.append(min(1, n))
        self._starts.append(self._starts[-1] + n)
        if len(self._ids) >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        self._ids_out.write(self._ids.tobytes())
        del self._ids[:]
        if self._mask_out is not None:
            self._mask_out.write(self._mask.tobytes())
            del self._mask[:]

    def finish(self) -> Tokens:
        self._flush()
        starts = np.frombuffer(self._starts, dtype=np.int64)
        first = np.frombuffer(self._first, dtype=np.int32)
        ids = self._read(self._ids_out, "ids.bin", ID)
        mask = self._read(self._mask_out, "mask.bin", np.uint8) if self._mask_out else None
        return Tokens(ids, mask, starts, first)

    def _read(self, out: BinaryIO, name: str, dtype: Any) -> np.ndarray:
        if isinstance(out, io.BytesIO):
            return np.frombuffer(out.getbuffer(), dtype=dtype)
        out.close()
        assert self.dir is not None
        path = self.dir / name
        if path.stat().st_size == 0:  # an empty file cannot be mapped
            return np.empty(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r")


def tokenize(
    tokenizer: Any, fmt: str, examples: Iterable[dict[str, Any]], dir: Path | None = None
) -> Tokens:
    """Every example's tokens, uncut, taken as `examples` yields them (the entries per
    format are in the module docstring); written under `dir` when given."""
    w = TokenWriter(dir, masked=fmt != "text")
    if fmt == "text":
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        docs = (ex["text"] for ex in examples)
        while batch := list(itertools.islice(docs, TEXT_BATCH)):
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                w.add(ids + eos)
        return w.finish()
    ensure_chat_template(tokenizer)
    for ex in examples:
        if fmt == "preference":
            for ids, mask in pair_tokens(tokenizer, ex):
                w.add(ids, mask)
        else:
            w.add(*example_tokens(tokenizer, fmt, ex))
    return w.finish()


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The tokens that end a turn: the generation config's (a chat model's end-of-turn
    token, often several) and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    for v in eos if isinstance(eos, list) else [eos]:
        if v is not None:
            ids.add(int(v))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
