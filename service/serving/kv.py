"""KV caches of the decode batch: rows stacked and padding cut (`stack_under`,
`cut_common_padding`), and prompts' keys and values kept across requests (`PrefixCache`).

Prefix caching:
A request whose prompt begins with the tokens of an earlier request's prompt, or of an
earlier conversation's prompt and answer, reads those tokens' keys and values from here
and is prefilled over the rest of its prompt only: a chat's system prompt and tools, a
conversation's earlier turns, an agent loop's growing transcript, or an RL group sent as
separate requests are computed once. OpenAI reports the reused tokens as
`usage.prompt_tokens_details.cached_tokens`, and so do we.

An entry is the key and value tensors of every layer for one token sequence, owned by
one tenant and one adapter, on the generator's device: a LoRA changes the keys and
values, and a tenant must not learn from `cached_tokens` (or from the time to a first
token) how another tenant's prompts begin, so entries are shared by neither (OpenAI
scopes its prompt cache to an organization likewise). Entries are bounded by bytes and
dropped least recently used first; an entry whose tokens begin another's is dropped for
the longer one. A match reuses at most all but the last prompt token, whose logits the
prefill needs, and only when it covers `min_tokens`.

Reused keys and values were computed over the same tokens at the same positions, so the
answer is the one a full prefill gives up to float rounding (the prefill's matmuls have
other shapes): greedy tokens agree in the tests, log-probabilities to 1e-4.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

Owner = tuple[str | None, str | None]  # (tenant, adapter key): whose keys and values


@dataclass
class Entry:
    owner: Owner
    ids: torch.Tensor  # [length] on the CPU
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # keys, values: [1, heads, length, dim]
    nbytes: int


@dataclass(frozen=True)
class Match:
    entry: Entry
    length: int  # tokens reused: the entry's first `length`

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self.entry.layers]


class PrefixCache:
    """Up to `max_bytes` of prompts' keys and values (0: none kept)."""

    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def match(self, owner: Owner, ids: list[int]) -> Match | None:
        """The entry of `owner` sharing the longest beginning with `ids`, if it covers
        `min_tokens` (the prompt's last token is never reused)."""
        if not self.enabled or len(ids) <= self.min_tokens:
            return None
        want = torch.tensor(ids, dtype=torch.long)
        best: tuple[int, int] | None = None  # (length, key)
        for key, e in self._entries.items():
            if e.owner != owner:
                continue
            n = min(len(e.ids), len(ids) - 1)
            same = e.ids[:n] == want[:n]
            common = n if bool(same.all()) else int(same.to(torch.int8).argmin())
            if common >= self.min_tokens and (best is None or common > best[0]):
                best = (common, key)
        if best is None:
            self.misses += 1
            return None
        self._entries.move_to_end(best[1])
        self.hits += 1
        self.reused_tokens += best[0]
        return Match(self._entries[best[1]], best[0])

    def wants(self, owner: Owner, ids: list[int]) -> bool:
        """Whether `store` would keep `ids` of `owner` (ask before copying them out)."""
        return self.enabled and len(ids) >= self.min_tokens and not self.holds(owner, ids)

    def store(
        self, owner: Owner, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Keep `layers` (each [1, heads, len(ids), dim], owned by the cache from here) as
        the keys and values of `ids` for `owner`."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if not self.enabled or len(ids) < self.min_tokens or nbytes > self.max_bytes:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for key, e in list(self._entries.items()):
            if e.owner != owner:
                continue
            n = min(len(e.ids), len(new))
            if torch.equal(e.ids[:n], new[:n]):
                if len(e.ids) >= len(new):  # already held, within a longer entry
                    self._entries.move_to_end(key)
                    return
                self._drop(key)  # the new entry holds it whole
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = Entry(owner, new, layers, nbytes)
        self._next += 1
        self.bytes += nbytes

    def holds(self, owner: Owner, ids: list[int]) -> bool:
        """Whether an entry of `owner` begins with all of `ids`."""
        want = torch.tensor(ids, dtype=torch.long)
        return any(
            e.owner == owner and len(e.ids) >= len(ids) and torch.equal(e.ids[: len(ids)], want)
            for e in self._entries.values()
        )

    def forget(self, adapter: str | None) -> None:
        """Drop every entry made with `adapter` (its weights left memory), any tenant's."""
        for key in [k for k, e in self._entries.items() if e.owner[1] == adapter]:
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def stats(self) -> dict[str, int]:
        return {
            "prefix_entries": len(self._entries),
            "prefix_bytes": self.bytes,
            "prefix_hits": self.hits,
            "prefix_misses": self.misses,
            "prefix_reused_tokens": self.reused_tokens,
        }


def stack_under(cache: Any, mask: torch.Tensor, more: Any, more_mask: torch.Tensor):
    """Stack the rows of `more` (a DynamicCache and its [rows, length] mask) under those of
    `cache`, in place, the shorter side padded on the left; the stacked mask."""
    width = max(mask.shape[1], more_mask.shape[1])
    for mine, theirs in zip(cache.layers, more.layers, strict=True):
        mine.keys = torch.cat([left_pad(mine.keys, width), left_pad(theirs.keys, width)])
        mine.values = torch.cat([left_pad(mine.values, width), left_pad(theirs.values, width)])
    return torch.cat([left_pad(mask, width), left_pad(more_mask, width)])


def cut_common_padding(cache: Any, mask: torch.Tensor) -> torch.Tensor:
    """Drop the leading cache columns that every row pads (rows that needed them left);
    the mask without them."""
    pad = int((mask.cumsum(1) == 0).all(0).sum())
    if pad:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, pad:]
            layer.values = layer.values[:, :, pad:]
    return mask[:, pad:]


def left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` padded with zeros on the left of its sequence axis (2 for K/V, 1 for a mask)."""
    axis = 2 if t.dim() == 4 else 1
    short = width - t.shape[axis]
    if short == 0:
        return t
    shape = list(t.shape)
    shape[axis] = short
    return torch.cat([t.new_zeros(shape), t], dim=axis)


def reused_cache(cache: Any, found: list[Match | None], width: int) -> None:
    """Fill the empty DynamicCache `cache` with each row's reused keys and values, left-
    padded to `width` columns (a row with nothing reused: all padding)."""
    some = next(m for m in found if m is not None).layers()
    rows = [m.layers() if m is not None else None for m in found]
    for i, (k0, v0) in enumerate(some):
        keys = [left_pad(r[i][0] if r else k0[:, :, :0], width) for r in rows]
        values = [left_pad(r[i][1] if r else v0[:, :, :0], width) for r in rows]
        cache.update(torch.cat(keys), torch.cat(values), i)


def row_layers(cache: Any, row: int, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s own keys and values (the columns its `mask` row marks), copied out of
    the batch: each [1, heads, tokens, dim]."""
    cols = mask[row].nonzero()[:, 0]
    return [
        (x.keys[row : row + 1].index_select(2, cols), x.values[row : row + 1].index_select(2, cols))
        for x in cache.layers
    ]
