"""What every benchmark prints last: the machine's load around the run, then one JSON line."""

from __future__ import annotations

import json
import os
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
