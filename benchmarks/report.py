"""What the benchmarks share: the machine's load, medians, reading a child process's last
JSON line, and what every benchmark prints last (the load around the run, then one JSON
line)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console


def finish(
    console: Console,
    result: dict[str, Any],
    load_before: Sequence[float],
    load_after: Sequence[float],
    json_out: bool,
    extra: str = "",
) -> dict[str, Any]:
    """Print the load line (and `extra`), then the result as one JSON line if asked."""
    fmt = ", ".join
    console.print(
        f"load avg (1/5/15 min) before {fmt(f'{v:.2f}' for v in load_before)}; "
        f"after {fmt(f'{v:.2f}' for v in load_after)}; {extra}cpus {os.cpu_count()}"
    )
    if json_out:
        print(json.dumps(result))
    return result


def load_avg() -> list[float]:
    """The 1/5/15-minute load averages, rounded: what else the machine was doing."""
    return [round(v, 2) for v in os.getloadavg()]


def median(xs: Sequence[float]) -> float:
    """The median, NaN for no samples (a run that produced none is visible, not an error)."""
    return statistics.median(xs) if xs else float("nan")


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of a child's output that is a JSON object, if any."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None
