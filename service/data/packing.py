"""Sequence packing: several short examples share one row of `seq_len` tokens.

One example per row, right-padded, spends the row's padding on compute that trains
nothing (on WordNet's chat pairs half of every row). Packed, the examples are placed
best-fit decreasing into rows of the same `seq_len` (so every batch keeps one shape and
the warm-up trace holds), and nothing changes what the model computes for an example:

- its positions restart at 0 (`position_ids`), so a model with learned or rotary
  positions sees the same positions as in a row of its own;
- attention stays inside it: transformers builds a block-diagonal causal mask when the
  position ids restart within a row and no attention mask or cache is given (its
  `find_packed_sequence_indices`; the worker passes `use_cache=False`), for SDPA and eager
  attention alike;
- the first token of every example gets no label, so no example is trained to predict
  the next one's first token from its own last (unpacked, that position predicts nothing
  either: labels shift by one inside the model).

The padding that is left at a row's end is a block of its own (positions from 0, no
labels). So a packed batch's loss per example equals that of the same examples unpacked
(`tests/service/test_packing.py`). A batch is then `batch_size` rows, each holding
`examples_per_row` examples on average (the data report says how many).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from service.data.datasets import IGNORE
from service.data.rows import ROW, RowWriter, counts, pad_id, pieces, place, to_rows
from service.data.tokens import as_tokens


def padding_share(tokens: Any, seq_len: int) -> float:
    """The share of the row slots that would be padding with one example per row."""
    t = as_tokens(tokens)
    kept = t.kept(seq_len)
    n = int(kept.sum())
    return 1.0 - int(t.cut(seq_len)[kept].sum()) / (n * seq_len) if n else 0.0


def rows(
    tokenizer: Any, tokens: Any, seq_len: int, packed: bool, out: Path | None = None, split="train"
):
    """The examples as rows: packed (`pack`) or one per row (`rows.to_rows`)."""
    make = pack if packed else to_rows
    return make(tokenizer, tokens, seq_len, out, split)


def pack(tokenizer: Any, tokens: Any, seq_len: int, out: Path | None = None, split="train"):
    """Rows of `seq_len` holding several examples each (best-fit decreasing, deterministic:
    ties keep the file's order), with `position_ids` restarting at every example and at the
    padding."""
    t = as_tokens(tokens)
    enc, cut = counts(t, seq_len), t.cut(seq_len)
    kept = np.flatnonzero(t.kept(seq_len))
    members, bounds = _best_fit_decreasing(cut[kept], seq_len)
    members = kept[members]  # as examples of the file
    n_bins = len(bounds) - 1
    out_rows = RowWriter(out, split, n_bins, (seq_len,), positions=True)
    pad, counting = pad_id(tokenizer), np.arange(seq_len, dtype=ROW)
    for piece in pieces(np.arange(n_bins)):
        ids = np.full((len(piece), seq_len), pad, ROW)
        labels = np.full((len(piece), seq_len), IGNORE, ROW)
        pos = np.empty((len(piece), seq_len), ROW)
        lengths = np.empty(len(piece), ROW)
        for r, b in enumerate(piece.tolist()):
            at = 0
            for k in members[bounds[b] : bounds[b + 1]].tolist():
                n = int(cut[k])
                # the first token is never a target: it would be predicted from the example
                # before it in the row
                end = at + n
                enc.loss_tokens += place(t, k, n, ids[r, at:end], labels[r, at:end], first=False)
                pos[r, at:end] = counting[:n]
                at = end
            lengths[r] = at
            pos[r, at:] = counting[: seq_len - at]
        out_rows.write(ids=ids, labels=labels, position_ids=pos, lengths=lengths)
    return out_rows.finish(enc)


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bins of `capacity` for `sizes`: longest first, each into the bin it fills most
    tightly (a new bin when none has room). Returns the indices grouped by bin, each bin's
    in the order they went in, and where each bin starts among them (`n_bins + 1`).
    O(n log n) with the bins' free space kept sorted, as one int per bin
    (`free << 32 | bin`), so ties go to the earliest bin."""
    n = len(sizes)
    order = np.lexsort((np.arange(n), -sizes.astype(np.int64)))
    bin_of = np.empty(n, np.int64)
    size = sizes.tolist()
    free: list[int] = []  # sorted
    n_bins = 0
    for i in order.tolist():
        k = bisect.bisect_left(free, size[i] << 32)
        if k == len(free):
            b, left = n_bins, capacity - size[i]
            n_bins += 1
        else:
            key = free.pop(k)
            b, left = key & 0xFFFFFFFF, (key >> 32) - size[i]
        bin_of[i] = b
        if left > 0:
            bisect.insort(free, left << 32 | b)
    grouped = order[np.argsort(bin_of[order], kind="stable")]
    bounds = np.zeros(n_bins + 1, np.int64)
    np.cumsum(np.bincount(bin_of, minlength=n_bins), out=bounds[1:])
    return grouped, bounds
