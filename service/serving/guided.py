"""Constrained decoding: each choice of a request with a grammar (a `json_schema`
response format, JSON text; or a `lark` grammar, a tool call) is decoded to it, token by
token, by llguidance (its matcher says which tokens may come next; the others' logits go to
-inf before the choice is drawn).

`grammar_of` reads a request's grammar; a `Guide` holds llguidance's view of one model's
tokenizer (made at the first grammar, about a second) and makes, checks and applies
matchers."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from service.data.tools import JSON_LAYOUT


def grammar_of(body: dict[str, Any]) -> str | None:
    """The grammar a request's answer is decoded to: its `lark` (a forced tool call) or its
    `json_schema` (response_format, JSON text) as llguidance takes it; None without.
    A value that is not JSON is a ValueError."""
    from llguidance import LLMatcher

    if body.get("lark"):
        return str(LLMatcher.grammar_from_lark(body["lark"]))
    if body.get("json_schema") is not None:
        layout: Any = JSON_LAYOUT  # llguidance's JsonCompileOptions, a TypedDict of it
        return str(LLMatcher.grammar_from_json_schema(body["json_schema"], defaults=layout))
    return None


NOT_FAST = "this model's tokenizer is not a fast tokenizer, which constrained decoding needs"


def tokenizer_problem(model_dir: Path) -> str | None:
    """Why the answers of the model in `model_dir` could not be decoded to a grammar (as
    `Guide.problem` would say at the first request), or None. A `tokenizer.json` is a fast
    tokenizer without loading it; otherwise the tokenizer is loaded to see (once per
    directory). One that does not load is left to the model's own start, which says why."""
    if (model_dir / "tokenizer.json").is_file():
        return None
    return None if _loads_fast(model_dir) else NOT_FAST


@functools.lru_cache(maxsize=64)
def _loads_fast(model_dir: Path) -> bool:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return True
    return bool(getattr(tokenizer, "is_fast", False))


class Guide:
    """Matchers of grammars over one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._view: Any = None  # llguidance's tokenizer, made at the first grammar

    def _tokenizer(self) -> Any:
        if self._view is None:
            import llguidance.hf

            self._view = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._view

    def matcher(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        return LLMatcher(self._tokenizer(), grammar, log_level=0)

    def problem(self, grammar: str) -> str | None:
        """Why answers cannot be decoded to `grammar` (`grammar_of`'s), or None."""
        if not getattr(self.tokenizer, "is_fast", False):
            return NOT_FAST
        try:
            matcher = self.matcher(grammar)
        except ValueError as e:
            return str(e)
        return matcher.get_error() if matcher.is_error() else None

    @staticmethod
    def constrain(logits: torch.Tensor, matchers: list[Any], at: list[int]) -> None:
        """Rows `at` of `logits` keep only the tokens their matcher allows next."""
        from llguidance.torch import fill_next_token_bitmask

        words = (logits.shape[-1] + 31) // 32
        bitmask = torch.full((len(at), words), -1, dtype=torch.int32)
        for j, m in enumerate(matchers):
            fill_next_token_bitmask(m, bitmask, j)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(at), -1)[:, : logits.shape[-1]].bool().to(logits.device)
        rows = torch.tensor(at, device=logits.device)
        with torch.inference_mode():  # the logits are the forward's inference tensor
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    @staticmethod
    def consume(matchers: list[Any], tokens: list[int]) -> None:
        """Each matcher takes its row's chosen token."""
        for m, t in zip(matchers, tokens, strict=True):
            m.consume_token(t)
