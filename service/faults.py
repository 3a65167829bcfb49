"""Crash points for fault-injection tests: `crash_point("name")` kills this process with
SIGKILL when `PSTAR_CRASH_AT` (comma-separated names) names it.

Only the control plane calls crash points, and the variable is read from the control
plane's own environment at import; nothing a client sends and nothing a job's code does
can set it. Unset (always, outside tests), a crash point is one set lookup.
"""

from __future__ import annotations

import os
import signal

_POINTS = frozenset(p.strip() for p in os.environ.get("PSTAR_CRASH_AT", "").split(",") if p)


def crash_point(name: str) -> None:
    if name in _POINTS:
        os.kill(os.getpid(), signal.SIGKILL)
