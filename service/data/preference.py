"""Preference data for DPO, in OpenAI's format: one pair per line,

    {"input": {"messages": [{"role": "user", "content": "..."}]},
     "preferred_output": [{"role": "assistant", "content": "..."}],
     "non_preferred_output": [{"role": "assistant", "content": "..."}]}

validated line by line at upload (`service.data.datasets`, format "preference") and tokenized
into two rows per pair: the prompt followed by the preferred answer, and the prompt
followed by the other, each rendered with the model's chat template as a chat example
whose only trained message is the answer (earlier assistant turns of the prompt are
context, `"weight": 0`). The DPO loss (`service.methods.dpo_objective`) takes the
log-probability of each answer's tokens, the labelled ones here.

Rows: `input_ids` and `labels` of shape (pairs, 2, seq_len), the preferred answer at
index 0; a pair whose prompt leaves either answer nothing within `seq_len` is dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from service.data.datasets import (
    NON_PREFERRED,
    PREFERRED,
    Encoded,
    cut_examples,
    ensure_chat_template,
    example_tokens,
    to_rows,
)


def as_chat(ex: dict[str, Any], key: str) -> dict[str, Any]:
    """The prompt and one answer as a chat example that trains on the answer only."""
    msgs = [
        {
            "role": m["role"],
            "content": m["content"],
            **({"weight": 0} if m["role"] == "assistant" else {}),
        }
        for m in ex["input"]["messages"]
    ]
    return {"messages": [*msgs, {"role": "assistant", "content": ex[key][0]["content"]}]}


def tokenize_pairs(tokenizer: Any, examples: list[dict[str, Any]]):
    """[(preferred (ids, mask), non-preferred (ids, mask))] of every pair, uncut."""
    ensure_chat_template(tokenizer)
    return [
        tuple(example_tokens(tokenizer, "chat", as_chat(ex, k)) for k in (PREFERRED, NON_PREFERRED))
        for ex in examples
    ]


def pair_rows(tokenizer: Any, pairs: list[tuple[Any, Any]], seq_len: int) -> Encoded:
    """Rows of shape (pairs, 2, seq_len): both answers of a pair cut to `seq_len`; a pair
    with nothing left to train on in either is dropped (and counted)."""
    kept_pairs, out = [], Encoded(torch.empty(0), torch.empty(0))
    for chosen, rejected in pairs:
        kept, counts = cut_examples([chosen, rejected], seq_len)
        out.examples += 1
        out.longest = max(out.longest, counts.longest)
        out.truncated += counts.truncated > 0
        if len(kept) < 2:
            out.dropped += 1
            continue
        out.tokens += counts.tokens
        out.loss_tokens += counts.loss_tokens
        kept_pairs.append(kept)
    sides = [to_rows(tokenizer, [p[i] for p in kept_pairs], seq_len) for i in (0, 1)]
    out.input_ids = torch.stack([s.input_ids for s in sides], dim=1)
    out.labels = torch.stack([s.labels for s in sides], dim=1)
    out.lengths = sides[0].lengths + sides[1].lengths
    return out
