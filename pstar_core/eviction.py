"""Victim choice when a tier is full: OPT (the paper), LRU and chunk-list order.

OPT evicts the chunk whose next use is farthest in the future, looked up by binary
search in the chunk's traced moment list; iterations repeat, so a chunk not used again
in this iteration is next used at its first moment of the next one.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from pstar_core.chunk import Chunk

NEVER = float("inf")
T = TypeVar("T")


def next_use(moments: Sequence[int], now: int, period: int) -> float:
    """The first traced use strictly after `now`, wrapping into the next iteration."""
    if not moments:
        return NEVER
    i = bisect.bisect_right(moments, now)
    if i < len(moments):
        return moments[i]
    return moments[0] + period


def opt_order(next_use: float, index: int) -> tuple[float, int]:
    """OPT's order, as a sort key: the farthest next use first, the lower index first
    among equals. The engine evicts (`choose_opt`) and sends ahead (`Residency`) in it,
    and the planner's forecast (`forecast._timeline`) evicts in it too."""
    return (-next_use, index)


def farthest_first(
    candidates: Iterable[T], next_use_of: Callable[[T], float], index_of: Callable[[T], int]
) -> list[T]:
    """`candidates` in OPT's order (`opt_order`)."""
    return sorted(candidates, key=lambda c: opt_order(next_use_of(c), index_of(c)))


def choose_opt(candidates: list[Chunk], moments_of, now: int, period: int) -> Chunk:
    """The first chunk in OPT's order (one pass, no sort)."""
    return min(candidates, key=lambda c: opt_order(next_use(moments_of(c), now, period), c.index))


def choose_lru(candidates: list[Chunk], last_use: dict[int, int]) -> Chunk:
    return min(candidates, key=lambda c: (last_use.get(id(c), -1), c.index))


def choose_in_list_order(candidates: list[Chunk]) -> Chunk:
    """Warm-up: nothing is known yet, so evict in chunk-list order."""
    return min(candidates, key=lambda c: (c.kind.value, c.index))
