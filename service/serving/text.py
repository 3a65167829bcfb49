"""The text of one choice as a stream releases it."""

from __future__ import annotations

from typing import Any


class TextStream:
    """The text of one choice, released as it becomes final: decoded from all its tokens
    so far (so multi-token characters come out whole), cut at the first stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted

    def add(self, token: int) -> tuple[str, bool]:
        """(the text now final, whether a stop string was reached)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                out = text[self.sent : at]
                self.sent = at
                return out, True
        safe = len(text)
        if text.endswith("\ufffd"):  # a character still arriving in later tokens
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back what could still become a stop string
            for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        out = text[self.sent : safe]
        self.sent = max(self.sent, safe)
        return out, False

    def rest(self) -> str:
        """What was held back, at the end of a choice that did not stop on a stop string."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        out = text[self.sent :]
        self.sent = len(text)
        return out
