"""Python graders: the caller's `grade(sample, item)` run in a process of its own with no
network, no files, no other programs or processes, and CPU, memory, output and time limits
(`python_sandbox.py` says how). Off unless the operator turns them on
(PSTAR_PYTHON_GRADERS=on): a grader is code from the tenant, and the sandbox bounds what
it can reach and cost, not what it is. At most `MAX_RUNNING` run at once in a process;
a call that finds no room within its wall-time limit is a 429."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.errors import QuotaExceeded

SANDBOX_FILE = Path(__file__).with_name("python_sandbox.py")
MAX_RUNNING = 4
OUTPUT_BYTES = 1 << 20  # what is read of the child's stdout and of its stderr
_RUNNING = threading.BoundedSemaphore(MAX_RUNNING)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 10  # CPU seconds for one batch of samples
    memory_bytes: int = 1 << 30  # address space, the interpreter's own included
    wall_s: float = 30.0  # wall-clock seconds for one batch (a grader that sleeps)


@dataclass(frozen=True)
class PythonScore:
    score: float
    error: str | None = None
    # who failed: the grader's code or its limits ("runtime"), or the sandbox ("server")
    kind: Literal["runtime", "server"] = "runtime"


def run_python(
    source: str, pairs: list[tuple[Any, Any]], limits: SandboxLimits | None = None
) -> list[PythonScore]:
    """`grade(sample, item)` of `source` on each pair, in one sandboxed process; a pair
    whose grade raised or gave no finite number, or a run that broke a limit, scores 0
    with the reason."""
    limits = limits or SandboxLimits()
    # a short wait: the caller holds one of the API's worker threads meanwhile
    if not _RUNNING.acquire(timeout=1.0):
        raise QuotaExceeded(
            f"{MAX_RUNNING} python graders are running on this server already; try again"
        )
    try:
        return _run(source, pairs, limits)
    finally:
        _RUNNING.release()


def _run(source: str, pairs: list, limits: SandboxLimits) -> list[PythonScore]:
    env = {  # nothing of the server's environment; one thread for the numeric libraries
        "PATH": os.defpath,
        "LANG": "C.UTF-8",
        **{k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    with tempfile.TemporaryDirectory(prefix="pstar-grader-", ignore_cleanup_errors=True) as d:
        paths = [Path(d, name) for name in ("out", "err", "confined")]
        with paths[0].open("wb") as out, paths[1].open("wb") as err, paths[2].open("wb") as mark:
            job = {
                "source": source,
                "pairs": pairs,
                "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_bytes,
                "confined_fd": mark.fileno(),
            }
            child = subprocess.Popen(
                [sys.executable, "-I", "-B", str(SANDBOX_FILE)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                pass_fds=(mark.fileno(),),
                cwd=d,
                env=env,
                start_new_session=True,  # its own process group, stopped whole on a timeout
            )
        try:
            child.communicate(json.dumps(job).encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # not reaped yet: the group is still its
            child.wait()
            return _all(pairs, f"the grader ran past its {limits.wall_s:g} s and was stopped")
        stdout, stderr, confined = (_head(p) for p in paths)
    return _scores(child.returncode, stdout, stderr, confined == "1", pairs, limits)


def _scores(
    code: int, stdout: str, stderr: str, confined: bool, pairs: list, limits: SandboxLimits
) -> list[PythonScore]:
    last = _last_line(stderr)
    if not confined:  # it never reached the caller's code: the sandbox failed
        return _all(pairs, last or f"the sandbox exited with {code}", "server")
    if code == 0:
        try:
            got = [_score(r) for r in json.loads(stdout)]
        except Exception:  # anything else the code wrote in place of the scores
            got = []
        if len(got) == len(pairs):
            return got
        return _all(pairs, "the grader's process wrote something that is not its scores")
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return _all(pairs, f"the grader used more than its {limits.cpu_s} s of CPU")
    return _all(pairs, last or f"the grader exited with {code}")


def _score(r: dict) -> PythonScore:
    if r.get("error") is not None:
        return PythonScore(0.0, _printable(str(r["error"])))
    value = float(r["score"])
    if not math.isfinite(value):
        return PythonScore(0.0, f"the grader returned {value}, not a finite number")
    return PythonScore(value)


def _printable(text: str) -> str:
    """`text` that encodes as UTF-8 (a lone surrogate would fail the response)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _head(path: Path) -> str:
    with path.open("rb") as f:
        return f.read(OUTPUT_BYTES).decode("utf-8", errors="replace")


def _all(pairs: list, error: str, kind: Literal["runtime", "server"] = "runtime"):
    return [PythonScore(0.0, error, kind) for _ in pairs]


def _last_line(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return _printable(lines[-1][-500:]) if lines else ""
