"""A spec's text for `pstar train`: the file read with clear errors, and a byte-level BPE
tokenizer trained on it for a zoo model (the rows are cut by `service.data.datasets.encode`)."""

from __future__ import annotations

from pathlib import Path

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
