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
from typing import Any

import torch

from service.data.datasets import IGNORE, Encoded, cut_examples, pad_id, to_rows


def padding_share(tokenized: list[tuple[list[int], list[int]]], seq_len: int) -> float:
    """The share of the row slots that would be padding with one example per row."""
    kept, counts = cut_examples(tokenized, seq_len)
    return 1.0 - counts.tokens / (len(kept) * seq_len) if kept else 0.0


def rows(tokenizer: Any, tokenized: list[Any], seq_len: int, packed: bool) -> Encoded:
    """The examples as rows: packed (`pack`) or one per row (`datasets.to_rows`)."""
    return pack(tokenizer, tokenized, seq_len) if packed else to_rows(tokenizer, tokenized, seq_len)


def pack(tokenizer: Any, tokenized: list[tuple[list[int], list[int]]], seq_len: int) -> Encoded:
    """Rows of `seq_len` holding several examples each (best-fit decreasing, deterministic:
    ties keep the file's order), with `position_ids` restarting at every example and at the
    padding."""
    pad = pad_id(tokenizer)
    kept, out = cut_examples(tokenized, seq_len)
    bins = _best_fit_decreasing([len(ids) for ids, _ in kept], seq_len)
    ids_rows, label_rows, pos_rows, lengths = [], [], [], []
    for members in bins:
        ids_row: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        for i in members:
            ids, mask = kept[i]
            ids_row += ids
            # the first token is never a target: it would be predicted from the example
            # before it in the row
            targets = zip(ids[1:], mask[1:], strict=True)
            labels += [IGNORE] + [t if m else IGNORE for t, m in targets]
            pos += range(len(ids))
        n = len(ids_row)
        lengths.append(n)
        ids_rows.append(ids_row + [pad] * (seq_len - n))
        label_rows.append(labels + [IGNORE] * (seq_len - n))
        pos_rows.append(pos + list(range(seq_len - n)))
    out.input_ids = torch.tensor(ids_rows, dtype=torch.long).view(-1, seq_len)
    out.labels = torch.tensor(label_rows, dtype=torch.long).view(-1, seq_len)
    out.position_ids = torch.tensor(pos_rows, dtype=torch.long).view(-1, seq_len)
    out.lengths = torch.tensor(lengths, dtype=torch.long)
    return out


def _best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` in bins of `capacity`: longest first, each into the bin it fills
    most tightly (a new bin when none has room). O(n log n) with the bins' free space kept
    sorted."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, bin index), sorted
    for i in order:
        k = bisect.bisect_left(free, (sizes[i], -1))
        if k == len(free):
            bins.append([i])
            left, b = capacity - sizes[i], len(bins) - 1
        else:
            left, b = free.pop(k)
            bins[b].append(i)
            left -= sizes[i]
        if left > 0:
            bisect.insort(free, (left, b))
    return bins
