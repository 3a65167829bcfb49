"""Python graders: the caller's `grade(sample, item)` run in a process of its own with no
network, no other programs, and CPU, memory and time limits (`python_sandbox.py` says how).
Off unless the operator turns them on (PSTAR_PYTHON_GRADERS=on): a grader is code from the
tenant, and the limits bound what it costs, not what it is."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SANDBOX = Path(__file__).with_name("python_sandbox.py")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 10  # CPU seconds for one batch of samples
    memory_bytes: int = 1 << 30  # address space, the interpreter's own included
    wall_s: float = 30.0  # wall-clock seconds for one batch (a grader that sleeps)


@dataclass(frozen=True)
class PythonScore:
    score: float
    error: str | None = None


def run_python(
    source: str, pairs: list[tuple[Any, Any]], limits: SandboxLimits = SandboxLimits()
) -> list[PythonScore]:
    """`grade(sample, item)` of `source` on each pair, in one sandboxed process; a pair
    whose grade raised, or a run that broke a limit, scores 0 with the reason."""
    job = {
        "source": source,
        "pairs": pairs,
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_bytes,
    }
    env = {"PATH": os.defpath, "LANG": "C.UTF-8"}  # nothing of the server's environment
    with tempfile.TemporaryDirectory(prefix="pstar-grader-") as cwd:
        with subprocess.Popen(
            [sys.executable, "-I", "-B", str(SANDBOX)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own process group, stopped whole below
        ) as child:
            try:
                out, err = child.communicate(json.dumps(job), timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                _stop(child)
                return _all(pairs, f"the grader ran past its {limits.wall_s:g} s and was stopped")
            finally:
                _stop(child)
        proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    if proc.returncode == 0:
        try:
            got = [PythonScore(float(r.get("score", 0.0)), r.get("error")) for r in _out(proc)]
            if len(got) == len(pairs):
                return got
        except (ValueError, TypeError, AttributeError):
            pass
        return _all(pairs, "the grader's process answered something that is not scores")
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        return _all(pairs, f"the grader used more than its {limits.cpu_s} s of CPU")
    return _all(pairs, _last_line(proc.stderr) or f"the grader exited with {proc.returncode}")


def _stop(child: subprocess.Popen) -> None:
    """Kill whatever is left of the child's process group (the sandbox forbids forks; this
    is the second line), and reap the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.communicate()


def _out(proc: subprocess.CompletedProcess) -> list[dict]:
    out = json.loads(proc.stdout)
    if not isinstance(out, list):
        raise ValueError(out)
    return out


def _all(pairs: list, error: str) -> list[PythonScore]:
    return [PythonScore(0.0, error) for _ in pairs]


def _last_line(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    return lines[-1][-500:] if lines else ""
