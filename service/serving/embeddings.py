"""Text embeddings: `POST /v1/embeddings` and the `cosine` metric of the `text_similarity`
grader, from the one model the operator names (PSTAR_EMBEDDING_MODEL: a directory).

The model is run by `sentence-transformers`, the library most embedding models are
published for: a sentence-transformers directory (`modules.json`: its own pooling and
normalization) is used as its authors made it; a plain transformers directory gets
sentence-transformers' default, the mean of its last hidden states. It is loaded once, on
first use, in the control plane's process (an embedding model is small beside the chat
models, which run in their own deployments); a request's texts are embedded in one batch,
one request at a time.

Limits, as OpenAI's: at most MAX_INPUTS texts a request, none empty, none longer than the
model's window (`max_seq_length`: a 400 naming the input) unless the request sets our
`truncate` (the window's first tokens are embedded), and MAX_REQUEST_TOKENS in all.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest

MAX_INPUTS = 2048  # texts one request may embed (OpenAI's limit)
MAX_REQUEST_TOKENS = 300_000  # tokens of all its texts together (OpenAI's limit)
MAX_INPUT_CHARS = 200_000  # read of one text before counting its tokens


@dataclass(frozen=True)
class Embedded:
    vectors: list[list[float]]  # one per text, in order (unit length if the model says so)
    tokens: int  # the texts' tokens, as the model's tokenizer counts them


class Embedder:
    """The operator's embedding model (see the module docstring), loaded on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self._model: Any = None
        self._lock = threading.Lock()
        # one batch at a time: a fast tokenizer's truncation and padding settings are
        # shared state (two threads tokenizing at once failed with a ragged batch)
        self._busy = threading.Lock()

    def model(self) -> Any:
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(
                    str(self.path), device="cpu", local_files_only=True
                )
            return self._model

    @property
    def window(self) -> int | None:
        """The most tokens the model embeds of one text (None: no limit)."""
        got = getattr(self.model(), "max_seq_length", None)
        return int(got) if got else None

    def lengths(self, texts: list[str]) -> list[int]:
        """Each text's tokens, special tokens included, before any cut."""
        tok = self.model().tokenizer
        if hasattr(tok, "encode_batch"):  # a `tokenizers.Tokenizer` (static embeddings)
            return [len(e.ids) for e in tok.encode_batch(texts)]
        ids = tok(texts, add_special_tokens=True, verbose=False)["input_ids"]
        return [len(one) for one in ids]

    def embed(
        self,
        texts: list[str],
        truncate: bool = False,
        param: str = "input",
        dimensions: int | None = None,
    ) -> Embedded:
        """The texts' embeddings; a 400 naming `param` for a text the limits refuse
        (`truncate`: a text longer than the window is cut to it instead). `dimensions`:
        each shortened to its first values, made unit length (`shortened`); more than the
        model has is a 400, before anything is embedded."""
        if not texts:
            raise InvalidRequest(f"{param}: give at least one text", param=param)
        if len(texts) > MAX_INPUTS:
            raise InvalidRequest(
                f"{param}: {len(texts)} texts, over the limit of {MAX_INPUTS} a request; "
                "send them in several requests",
                param=param,
            )
        for i, text in enumerate(texts):
            where = f"{param}[{i}]" if len(texts) > 1 else param
            if not text:
                raise InvalidRequest(f"{where}: the text is empty", param=param)
            if len(text) > MAX_INPUT_CHARS and not truncate:
                raise InvalidRequest(
                    f"{where}: {len(text)} characters, more than the model's window of "
                    f"{self.window} tokens can hold; shorten it or set truncate",
                    param=param,
                )
        if dimensions is not None:
            model = self.model()
            width = (
                getattr(model, "get_embedding_dimension", None)
                or model.get_sentence_embedding_dimension
            )()
            if width is not None and dimensions > width:
                raise InvalidRequest(
                    f"dimensions: {dimensions} is more than the model {self.name}'s {width}; "
                    f"ask for {width} or fewer",
                    param="dimensions",
                )
        texts = [t[:MAX_INPUT_CHARS] for t in texts]
        with self._busy:
            got = self._embedded(texts, truncate, param)
        if dimensions is None:
            return got
        return Embedded([shortened(v, dimensions) for v in got.vectors], got.tokens)

    def _embedded(self, texts: list[str], truncate: bool, param: str) -> Embedded:
        lengths, window = self.lengths(texts), self.window
        if window is not None:
            for i, n in enumerate(lengths):
                if n > window and not truncate:
                    where = f"{param}[{i}]" if len(texts) > 1 else param
                    raise InvalidRequest(
                        f"{where}: {n} tokens, over the model {self.name}'s window of "
                        f"{window}; shorten it, or set truncate to embed its first {window}",
                        param=param,
                    )
            lengths = [min(n, window) for n in lengths]
        if sum(lengths) > MAX_REQUEST_TOKENS:
            raise InvalidRequest(
                f"{param}: {sum(lengths)} tokens in all, over the limit of "
                f"{MAX_REQUEST_TOKENS} a request; send the texts in several requests",
                param=param,
            )
        got = self.model().encode(texts, convert_to_numpy=True, show_progress_bar=False)
        return Embedded([[float(x) for x in row] for row in got], sum(lengths))


def shortened(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` values, made unit length again (OpenAI's `dimensions`, as its
    documentation says to shorten an embedding by hand)."""
    part = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in part))
    return [x / norm for x in part] if norm > 0 else part
