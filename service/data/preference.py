"""Preference data for DPO, in OpenAI's format: one pair per line,

    {"input": {"messages": [{"role": "user", "content": "..."}]},
     "preferred_output": [{"role": "assistant", "content": "..."}],
     "non_preferred_output": [{"role": "assistant", "content": "..."}]}

validated line by line at upload (`service.data.datasets`, format "preference") and tokenized
into two rows per pair (`datasets.pair_tokens`): the prompt followed by the preferred
answer, and the prompt followed by the other, each rendered with the model's chat template
as a chat example whose only trained message is the answer (earlier assistant turns of the
prompt are context, `"weight": 0`). The DPO loss (`service.methods.dpo_objective`) takes the
log-probability of each answer's tokens, the labelled ones here.

Rows: `input_ids` and `labels` of shape (pairs, 2, seq_len), the preferred answer at
index 0; a pair whose prompt leaves either answer nothing within `seq_len` is dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.data.datasets import IGNORE
from service.data.rows import ROW, RowWriter, counts, pad_id, pieces, place
from service.data.tokens import Tokens


def pair_rows(tokenizer: Any, tokens: Tokens, seq_len: int, out: Path | None = None, split="train"):
    """Rows of shape (pairs, 2, seq_len) from `tokens` (two entries a pair:
    `service.data.tokens.tokenize`): both answers of a pair cut to `seq_len`; a pair with
    nothing left to train on in either is dropped (and counted)."""
    cut, kept = tokens.cut(seq_len), tokens.kept(seq_len)
    both = kept[0::2] & kept[1::2]
    pairs = np.flatnonzero(both)
    enc = counts(tokens, seq_len)
    enc.examples = len(tokens) // 2
    enc.truncated = int(
        ((cut[0::2] < tokens.lengths[0::2]) | (cut[1::2] < tokens.lengths[1::2])).sum()
    )
    enc.dropped = enc.examples - len(pairs)
    enc.tokens = int((cut[0::2] + cut[1::2])[both].sum())
    rows = RowWriter(out, split, len(pairs), (2, seq_len))
    pad = pad_id(tokenizer)
    for piece in pieces(pairs):
        ids = np.full((len(piece), 2, seq_len), pad, ROW)
        labels = np.full((len(piece), 2, seq_len), IGNORE, ROW)
        for r, p in enumerate(piece.tolist()):
            for side in (0, 1):
                k = 2 * p + side
                n = int(cut[k])
                enc.loss_tokens += place(tokens, k, n, ids[r, side], labels[r, side], first=True)
        rows.write(ids=ids, labels=labels, lengths=cut[2 * piece] + cut[2 * piece + 1])
    return rows.finish(enc)
