"""Text data for training: a BPE tokenizer trained on the text, token streams, batches."""

from __future__ import annotations

from pathlib import Path

import torch

from pstar_core.config import ConfigError


def read_text(path: Path, max_chars: int | None = None) -> str:
    if not path.is_file():
        raise ConfigError(
            f"data.path: {path} does not exist; run scripts/setup.sh (it prepares "
            ".cache/data/kjv.txt) or name another text file"
        )
    text = path.read_text(encoding="utf-8", errors="replace")
    if max_chars:
        text = text[:max_chars]
    if len(text) < 1000:
        raise ConfigError(f"data.path: {path} has only {len(text)} characters; need at least 1000")
    return text


def train_tokenizer(text: str, vocab_size: int, out: Path):
    """A byte-level BPE tokenizer trained on the text itself (< a few seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tok


def encode(tok, text: str, eos: int) -> torch.Tensor:
    """Token ids of every line, each line followed by `eos` (a `tokenizers.Tokenizer`)."""
    lines = text.splitlines()
    ids: list[int] = []
    for enc in tok.encode_batch(lines, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def split(tokens: torch.Tensor, seq_len: int, heldout_fraction: float):
    """Cut into sequences; the last `heldout_fraction` of them are held out."""
    n = tokens.numel() // seq_len
    seqs = tokens[: n * seq_len].view(n, seq_len)
    n_held = max(1, int(n * heldout_fraction))
    if n - n_held < 1:
        raise ConfigError(f"data: only {n} sequences of {seq_len} tokens; use more text")
    return seqs[: n - n_held], seqs[n - n_held :]


class BatchSampler:
    """Random batches of training sequences from a seeded generator (resumable by step)."""

    def __init__(self, seqs: torch.Tensor, batch_size: int, seed: int) -> None:
        self.seqs, self.batch_size, self.seed = seqs, batch_size, seed

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randint(0, self.seqs.shape[0], (self.batch_size,), generator=g)
        return self.seqs[idx]
