"""Rows from tokenized examples (`service.data.tokens`), made and written in pieces.

One example per row (`to_rows`): right-padded to `seq_len`, labels where the loss mask
says, longer examples cut and those left with nothing to train on dropped (both counted).
Text (`text_rows`): the documents end to end cut into full rows, every token a label.
Packed rows are `service.data.packing`'s, preference pairs `service.data.preference`'s.

A job's rows are `.npy` files in one directory (`RowWriter`, `load_rows`), int32, each
written as its rows are made, header first (the number of rows is known before the first
is made: the kept examples, the bins, or the cuts), so making them holds `PIECE` rows at a
time however large the file. Workers map the files (`load_rows`) and read only the rows
of their batches; `Split.rows` widens them to int64 for the model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.data.datasets import IGNORE, Encoded
from service.data.tokens import Tokens, as_tokens

ROW = np.int32
PIECE = 2048  # rows made and written at a time


def pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return 0 if pad is None else pad


class Column:
    """One array of rows, filled in pieces: a `.npy` file under `out`, or memory."""

    def __init__(self, out: Path | None, name: str, shape: tuple[int, ...]) -> None:
        self.shape, self.n = shape, 0
        self.path = out / f"{name}.npy" if out is not None else None
        if self.path is None:
            self.array = np.empty(shape, ROW)
            return
        self.file = self.path.open("wb")
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(ROW)), "fortran_order": False}
        np.lib.format.write_array_header_1_0(self.file, {**header, "shape": shape})

    def write(self, piece: np.ndarray) -> None:
        piece = np.ascontiguousarray(piece, dtype=ROW)
        if self.path is None:
            self.array[self.n : self.n + len(piece)] = piece
        else:
            self.file.write(piece.tobytes())
        self.n += len(piece)

    def done(self) -> torch.Tensor:
        assert self.n == self.shape[0], (self.n, self.shape)
        if self.path is None:
            return torch.from_numpy(self.array)
        self.file.close()
        return _mapped(self.path)


def _mapped(path: Path) -> torch.Tensor:
    """A `.npy` file as a tensor over its pages (copy-on-write: a worker's writes stay
    its own, its reads share the page cache with the other workers on the node)."""
    arr = np.load(path, mmap_mode="c") if _has_data(path) else np.load(path)
    return torch.from_numpy(arr)


def _has_data(path: Path) -> bool:
    with path.open("rb") as f:
        np.lib.format.read_magic(f)
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        return int(np.prod(shape)) * dtype.itemsize > 0


class RowWriter:
    """A split's rows (`<split>_ids`, `_labels`, `_lengths`, and `_position_ids` when
    packed), `n` of them, each `tail` (`(seq_len,)`, or `(2, seq_len)` for pairs)."""

    def __init__(
        self, out: Path | None, split: str, n: int, tail: tuple[int, ...], positions: bool = False
    ) -> None:
        names = ["ids", "labels"] + (["position_ids"] if positions else [])
        self.cols = {k: Column(out, f"{split}_{k}", (n, *tail)) for k in names}
        self.cols["lengths"] = Column(out, f"{split}_lengths", (n,))

    def write(self, **pieces: np.ndarray) -> None:
        for k, piece in pieces.items():
            self.cols[k].write(piece)

    def finish(self, enc: Encoded) -> Encoded:
        """`enc` (its counts) with the rows."""
        enc.input_ids, enc.labels = self.cols["ids"].done(), self.cols["labels"].done()
        enc.lengths = self.cols["lengths"].done()
        if "position_ids" in self.cols:
            enc.position_ids = self.cols["position_ids"].done()
        return enc


def pieces(items: np.ndarray) -> Iterator[np.ndarray]:
    for a in range(0, len(items), PIECE):
        yield items[a : a + PIECE]


def counts(t: Tokens, seq_len: int) -> Encoded:
    """What cutting the examples to `seq_len` finds (read, cut, dropped, the longest, the
    kept tokens); the rows and the loss tokens are filled as the rows are made."""
    cut, kept = t.cut(seq_len), t.kept(seq_len)
    enc = Encoded(torch.empty(0), torch.empty(0))
    enc.examples, enc.longest = len(t), t.longest
    enc.truncated = int((t.lengths > seq_len).sum())
    enc.dropped = int((~kept).sum())
    enc.tokens = int(cut[kept].sum())
    return enc


def place(t: Tokens, k: int, n: int, ids: np.ndarray, labels: np.ndarray, first: bool) -> int:
    """Example `k`'s first `n` tokens into a row's slots `ids` and `labels` (the label is
    the token where the loss mask is set; never on the first token when `first` is False,
    as in a packed row); returns the tokens the loss is taken on."""
    x, m = t.example(k, n)
    ids[:n] = x
    labels[:n] = np.where(m.astype(bool), x, IGNORE)
    if not first:
        labels[0] = IGNORE
    return int(m[1:].sum())


def to_rows(tokenizer: Any, tokens: Any, seq_len: int, out: Path | None = None, split="train"):
    """Right-padded rows of `seq_len` with labels, one example each; cut and dropped
    examples counted."""
    t = as_tokens(tokens)
    enc, cut = counts(t, seq_len), t.cut(seq_len)
    kept = np.flatnonzero(t.kept(seq_len))
    rows = RowWriter(out, split, len(kept), (seq_len,))
    pad = pad_id(tokenizer)
    for piece in pieces(kept):
        ids = np.full((len(piece), seq_len), pad, ROW)
        labels = np.full((len(piece), seq_len), IGNORE, ROW)
        for r, k in enumerate(piece.tolist()):
            enc.loss_tokens += place(t, k, int(cut[k]), ids[r], labels[r], first=True)
        rows.write(ids=ids, labels=labels, lengths=cut[piece])
    return rows.finish(enc)


def prompt_rows(
    tokenizer: Any, tokens: Tokens, seq_len: int, room: int, out: Path | None = None, split="train"
) -> tuple[Encoded, np.ndarray]:
    """Reinforcement prompts, one a row, right-padded to `seq_len`, no labels (the answers
    are sampled into the `room` tokens after each prompt); a prompt longer than
    `seq_len - room` is dropped (counted), never cut. Also the kept examples' indices."""
    fits = tokens.lengths <= seq_len - room
    kept = np.flatnonzero(fits)
    enc = Encoded(torch.empty(0), torch.empty(0), examples=len(tokens), longest=tokens.longest)
    enc.dropped = len(tokens) - len(kept)
    enc.tokens = int(tokens.lengths[kept].sum())
    rows = RowWriter(out, split, len(kept), (seq_len,))
    pad = pad_id(tokenizer)
    for piece in pieces(kept):
        ids = np.full((len(piece), seq_len), pad, ROW)
        for r, k in enumerate(piece.tolist()):
            n = int(tokens.lengths[k])
            ids[r, :n] = tokens.example(k, n)[0]
        labels = np.full((len(piece), seq_len), IGNORE, ROW)
        rows.write(ids=ids, labels=labels, lengths=tokens.lengths[piece])
    return rows.finish(enc), kept


def text_rows(tokens: Tokens, seq_len: int, out: Path | None = None, split="train") -> Encoded:
    """The documents end to end, cut into full rows of `seq_len` (the rest left out)."""
    n = len(tokens.ids) // seq_len
    enc = Encoded(torch.empty(0), torch.empty(0), examples=len(tokens), longest=tokens.longest)
    enc.tokens, enc.loss_tokens = n * seq_len, n * (seq_len - 1)
    rows = RowWriter(out, split, n, (seq_len,))
    for piece in pieces(np.arange(n)):
        a, b = int(piece[0]) * seq_len, (int(piece[-1]) + 1) * seq_len
        ids = tokens.ids[a:b].reshape(-1, seq_len)
        rows.write(ids=ids, labels=ids, lengths=np.full(len(piece), seq_len))
    return rows.finish(enc)


# -- a job's rows on disk ---------------------------------------------------------------


def fresh(path: Path) -> Path:
    """An empty directory to write `path`'s rows into (`publish` moves it into place)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """The rows written under `tmp` become `path`, whole or not at all."""
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def save_rows(path: Path, train: Encoded, valid: Encoded | None) -> None:
    """Rows made in memory (`pstar train`'s) written as a job's are."""
    tmp = fresh(path)
    for split, enc in (("train", train), ("valid", valid)):
        if enc is None:
            continue
        named = {"ids": enc.input_ids, "labels": enc.labels, "lengths": enc.lengths}
        if enc.position_ids is not None:
            named["position_ids"] = enc.position_ids
        for k, v in named.items():
            np.save(tmp / f"{split}_{k}.npy", v.numpy().astype(ROW))
    publish(tmp, path)


def load_rows(path: Path | str) -> dict[str, torch.Tensor]:
    """A job's rows by name (`train_ids`, `valid_labels`, ...), mapped, not read."""
    return {p.stem: _mapped(p) for p in sorted(Path(path).glob("*.npy"))}
