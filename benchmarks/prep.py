"""`pstar bench prep`: where a large training file's memory goes.

`pstar serve` (SQLite, its local Ray head) takes an upload of `--mb` MiB of chat
examples, a dry run of a job on it (`/validate`), and the job itself, whose data
preparation is followed for up to `--prep-timeout` seconds and then cancelled (a 1 GiB
file takes far longer than that to tokenize on a laptop's cores). Meanwhile the resident
memory of three groups of processes is sampled every 0.2 s:

- `api`: the `pstar serve` process (the control plane every tenant shares);
- `head`: Ray's own processes on the head (GCS, raylet, dashboard and its agents, the job
  supervisor);
- `driver`: the job's Ray driver, on the head (it starts in the job's phase: its growth
  is its whole size, mostly the libraries it imports);
- `task`: the Ray worker that runs the job's data preparation (`prepare <job id>`).

What grows with the file's size should be the task alone: the file goes to disk as it
arrives, the dry run reads a bounded sample, and the job tokenizes in a task on a worker,
which reserves the memory it needs (`resources.memory_per_worker`). The first dry run
also loads the tokenizer and the planner's libraries into the API process; the second
shows what a dry run costs once they are there.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish, load_avg, machine
from benchmarks.serve_process import ServeProcess

TOKEN = "bench-prep-token"
MODEL = "gpt-tiny"  # a zoo model: no model directory needed
MB = 1 << 20
HEAD_MARKS = ("gcs_server", "raylet", "dashboard", "log_monitor", "JobSupervisor", "monitor.py")
GROUPS = ("api", "head", "driver", "task")
WORDS = ("apple", "river", "stone", "light", "music", "garden", "winter", "paper", "cloud")


def write_chat_file(path: Path, size: int, seed: int = 0) -> int:
    """About `size` bytes of chat examples (about 1 KB a line); the lines written."""
    rng = random.Random(seed)
    lines = 0
    with path.open("w") as f:
        written = 0
        while written < size:
            words = " ".join(rng.choice(WORDS) for _ in range(80))
            msgs = [
                {"role": "user", "content": f"Say something about {rng.choice(WORDS)}."},
                {"role": "assistant", "content": words},
            ]
            line = json.dumps({"messages": msgs}) + "\n"
            f.write(line)
            written += len(line)
            lines += 1
    return lines


def _group(proc: Any, api_pid: int) -> tuple[str, str] | None:
    """(group, the process's part in it) of a process the benchmark follows."""
    if proc.pid == api_pid:
        return "api", "api"
    cmd = " ".join(proc.info.get("cmdline") or [])
    if "prepare" in cmd and "ray::" in cmd:
        return "task", "task"
    if "service.control.driver" in cmd:
        return "driver", "driver"
    for mark in HEAD_MARKS:
        if mark in cmd:
            return "head", mark
    return None


def _anon(pid: int) -> int:
    """A process's anonymous resident memory (its heap), in bytes: what resident memory
    counts beside the pages of files it maps, which the kernel can drop and read again."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """The resident memory of each group, summed, every `every` seconds."""

    def __init__(self, api_pid: int, every: float = 0.2) -> None:
        self.api_pid, self.every = api_pid, every
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> dict[str, int]:
        import psutil

        out = dict.fromkeys(GROUPS, 0)
        for p in psutil.process_iter(["cmdline"]):
            try:
                g = _group(p, self.api_pid)
                if g is not None:
                    rss = p.memory_info().rss
                    out[g[0]] += rss
                    if g[0] == "head":  # which of Ray's processes, summed by kind
                        out[f"head:{g[1]}"] = out.get(f"head:{g[1]}", 0) + rss
                    if g[0] == "task":  # its own memory, without the files it maps
                        out["task:anon"] = out.get("task:anon", 0) + _anon(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for g, v in self.now().items():
                self.peak[g] = max(self.peak.get(g, 0), v)
                self.base.setdefault(g, 0)  # a process that started during the phase

    def __enter__(self) -> Sampler:
        self.base = self.now()
        self.peak = dict(self.base)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self) -> dict[str, float]:
        """MiB each group grew by at its peak, over its resident memory when it began."""
        return {g: round((self.peak.get(g, 0) - self.base[g]) / MB, 1) for g in self.base}


def run(
    *, mb: int = 1024, prep_timeout_s: float = 240.0, seed: int = 0, json_out: bool = False
) -> dict[str, Any]:
    import httpx

    if mb < 1 or prep_timeout_s <= 0:
        raise ValueError("--mb must be at least 1 and --prep-timeout positive")
    console = Console(stderr=json_out)
    load_before = load_avg()
    root = Path(tempfile.mkdtemp(prefix="pstar-prep-"))
    serve = None
    phases: list[dict[str, Any]] = []
    try:
        data = root / "train.jsonl"
        lines = write_chat_file(data, mb * MB, seed)
        data_dir = root / "data"
        data_dir.mkdir()
        serve = ServeProcess(data_dir, f"bench:{TOKEN}", {"PSTAR_MAX_UPLOAD_BYTES": str(2 << 30)})
        serve.start()
        assert serve.proc is not None
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=serve.url, headers=headers, timeout=3600) as http:

            def phase(name: str, fn: Any) -> Any:
                t0 = time.monotonic()
                with Sampler(serve.proc.pid) as s:  # type: ignore[union-attr]
                    out = fn()
                phases.append({"phase": name, "s": round(time.monotonic() - t0, 1), **s.growth()})
                console.print(f"[dim]{name}: {phases[-1]}[/]")
                return out

            def upload() -> str:
                with data.open("rb") as f:
                    r = http.post(
                        "/v1/files",
                        files={"file": ("train.jsonl", f)},
                        data={"purpose": "fine-tune"},
                    )
                r.raise_for_status()
                return r.json()["id"]

            file_id = phase("upload", upload)
            body = {
                "model": MODEL,
                "training_file": file_id,
                "hyperparameters": {"max_steps": 1, "n_epochs": 1},
                "resources": {"num_workers": 1},
            }

            def validate() -> dict[str, Any]:
                r = http.post("/v1/fine_tuning/jobs/validate", json=body)
                r.raise_for_status()
                return r.json()

            phase("validate", validate)
            report = phase("validate again", validate)

            def job() -> str:
                r = http.post("/v1/fine_tuning/jobs", json=body)
                r.raise_for_status()
                jid = r.json()["id"]
                deadline = time.monotonic() + prep_timeout_s
                while time.monotonic() < deadline:
                    events = http.get(f"/v1/fine_tuning/jobs/{jid}/events?limit=100").json()
                    if any(e["message"].startswith("Data: ") for e in events["data"]):
                        return "prepared"
                    status = http.get(f"/v1/fine_tuning/jobs/{jid}").json()["status"]
                    if status in ("failed", "cancelled", "succeeded"):
                        return status
                    time.sleep(1.0)
                http.post(f"/v1/fine_tuning/jobs/{jid}/cancel")
                return f"cancelled after {prep_timeout_s:.0f} s of preparation"

            ended = phase("job (data preparation)", job)
    finally:
        if serve is not None:
            serve.stop()
        shutil.rmtree(root, ignore_errors=True)
    table = Table(title=f"Where a {mb} MiB training file's memory goes ({lines} lines)")
    table.add_column("phase")
    table.add_column("s")
    for g in GROUPS:
        table.add_column(f"{g} +MiB")
    table.add_column("task heap +MiB")
    for p in phases:
        heap = str(p.get("task:anon", ""))
        table.add_row(p["phase"], str(p["s"]), *(str(p[g]) for g in GROUPS), heap)
    console.print(table)
    console.print(f"the job: {ended}; the dry run read {report['data'].get('sampled')}")
    out = {
        "bench": "prep",
        "mb": mb,
        "lines": lines,
        "phases": phases,
        "job": ended,
        "validate_sampled": report["data"].get("sampled"),
        "api_growth_mb": max(p["api"] for p in phases),
        "head_growth_mb": max(p["head"] for p in phases),
        "driver_peak_mb": max(p["driver"] for p in phases),
        "task_growth_mb": max(p["task"] for p in phases),
        "task_heap_growth_mb": max(p.get("task:anon", 0.0) for p in phases),
        **machine("fp32"),
        "load_before": load_before,
    }
    return finish(console, out, load_before, load_avg(), json_out)
