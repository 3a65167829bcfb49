"""Fault benchmark: fine-tuning jobs under a schedule of random faults, on SQLite and
PostgreSQL; none may be lost, run twice or end in the wrong state.

What runs, per database
- `pstar serve` as users start it (its own local Ray head, the reconciler at 1 s), in its
  own process; the store is SQLite in the data dir or a throw-away PostgreSQL
  (`service.tools.pg_local`).
- `jobs` fine-tuning jobs created through the REST API: the zoo's `gpt-small` (5.3M
  parameters) trained from scratch on a small chat file, batches of 8 rows of 128 tokens,
  1 Ray Train worker, `steps` steps, a checkpoint every `steps // 4`, 5 attempts allowed.
- `faults` faults, one at a time at random gaps (seeded), each drawn from:
  - `control-plane`: `pstar serve` SIGKILLed, started again 1-4 s later (it re-attaches
    to the head; the jobs train on meanwhile);
  - `driver`: the Ray job driver of a running job SIGKILLed (its workers go with it); the
    reconciler must start the next attempt, which resumes from the last checkpoint. A
    job gets at most 2 of these (it has 5 attempts);
  - `store` (PostgreSQL only): the database server stopped as a crash would, for
    `outage_s` seconds, then started again; workers, drivers and the control plane must
    all ride it out.
- While the faults run, a poller reads the job list and one job every 0.2 s: the p99 of
  the answers it got (any status), and how many requests found no server.

What is counted, when every job has ended (or `timeout_s` passed)
- `lost`: a job the API accepted that is not in the store, or not finished by the end;
- `duplicated`: a job two of whose attempts ran at once in Ray (their drivers' lifetimes
  overlap), or with a Ray submission the store has no attempt for;
- `wrong_state`: a finished job that did not succeed, or whose metric steps are not each
  step 0..steps exactly once (a resumed attempt that skipped or repeated steps).

    pstar bench faults --json
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.api import chat_jsonl
from benchmarks.report import finish, load_avg, machine
from benchmarks.serve_process import ServeProcess

__all__ = ["run"]

TOKEN = "tok-bench-faults-0123456789"
MODEL = "gpt-small"  # 5.3M parameters: steps long enough for faults to land mid-job
KINDS = ("control-plane", "driver", "store")
DRIVER_KILLS_PER_JOB = 2
MAX_ATTEMPTS = 5
BATCH = 8  # rows a step
MAX_EPOCHS = 50  # the API's ceiling on n_epochs
TERMINAL = ("succeeded", "failed", "cancelled")


class _Poller(threading.Thread):
    """Reads the API every 0.2 s while faults run: latencies of answers, and misses."""

    def __init__(self, url: str, job_ids: list[str]) -> None:
        super().__init__(daemon=True, name="faults-poller")
        self.url, self.job_ids = url, job_ids
        self.latencies_ms: list[float] = []
        self.statuses: dict[int, int] = {}
        self.no_server = 0
        self.done = threading.Event()

    def run(self) -> None:
        import httpx

        rng = random.Random(1)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as http:
            while not self.done.wait(0.2):
                path = (
                    "/v1/fine_tuning/jobs?limit=20"
                    if rng.random() < 0.5
                    else f"/v1/fine_tuning/jobs/{rng.choice(self.job_ids)}"
                )
                t0 = time.perf_counter()
                try:
                    r = http.get(path)
                except httpx.HTTPError:
                    self.no_server += 1
                    continue
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1


@dataclass
class _Result:
    db: str
    jobs: int
    faults: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    wrong_state: list[str] = field(default_factory=list)
    attempts: int = 0
    wall_s: float = 0.0
    p99_ms: float | None = None
    p50_ms: float | None = None
    no_server: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)  # a restarted control plane's


def _ok(r: Any) -> None:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text}")


def _drivers(job_id: str) -> list[Any]:
    """The Ray job driver processes (`python -m service.control.driver JOB N`) of a job."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "service.control.driver" in cmd and job_id in cmd and "-m" in cmd:
            out.append(p)
    return out


def _jobs_now(http: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for jid in ids:
        r = http.get(f"/v1/fine_tuning/jobs/{jid}")
        if r.status_code == 200:
            out[jid] = r.json()
    return out


def _all_ended(serve: ServeProcess, ids: list[str]) -> bool:
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=serve.url, headers=headers, timeout=30) as http:
            now = _jobs_now(http, ids)
    except httpx.HTTPError:
        return False
    return len(now) == len(ids) and all(v["status"] in TERMINAL for v in now.values())


def _inject(
    kind: str,
    serve: ServeProcess,
    pg: Any,
    ids: list[str],
    kills: dict[str, int],
    rng: random.Random,
    outage_s: float,
    say: Any,
    ready_s: list[float],
) -> bool:
    """One fault; False when there was nothing to inject it into (no running driver)."""
    import httpx

    if kind == "control-plane":
        serve.kill9()
        down = rng.uniform(1.0, 4.0)
        say(f"control plane SIGKILLed; started again in {down:.1f} s")
        time.sleep(down)
        ready_s.append(round(serve.start(), 1))
        say(f"control plane ready {ready_s[-1]:.1f} s after its start")
        return True
    if kind == "store":
        say(f"store stopped for {outage_s:.0f} s")
        pg.halt()
        time.sleep(outage_s)
        pg.resume()
        return True
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=serve.url, headers=headers, timeout=30) as http:
        jobs = _jobs_now(http, ids)
    running = [
        j
        for j, v in jobs.items()
        if v["status"] == "running" and kills.get(j, 0) < DRIVER_KILLS_PER_JOB
    ]
    rng.shuffle(running)
    for jid in running:
        procs = _drivers(jid)
        if not procs:
            continue
        for p in procs:
            with contextlib.suppress(Exception):
                p.send_signal(signal.SIGKILL)
        kills[jid] = kills.get(jid, 0) + 1
        say(f"driver of {jid} (attempt {jobs[jid]['attempt']}) SIGKILLed")
        return True
    statuses = {j: v["status"] for j, v in jobs.items()}
    say(f"no driver to kill: jobs {statuses}, kills so far {kills}")
    return False


def _check(
    db: str, url: str, ray_url: str | None, ids: list[str], steps: int, ray_token: Path
) -> _Result:
    """Read the store and Ray directly: what was lost, run twice, or ended wrongly."""
    from service.store import Store

    res = _Result(db, len(ids))
    ray_jobs: dict[str, Any] = {}
    if ray_url:
        from ray.job_submission import JobSubmissionClient

        from service import ray_auth

        auth = ray_auth.headers(ray_auth.local_env(ray_token))
        for info in JobSubmissionClient(ray_url, headers=auth).list_jobs():
            if info.submission_id:
                ray_jobs[info.submission_id] = info
    store = Store(url)
    try:
        for jid in ids:
            job = store.jobs.get(jid)
            if job is None:
                res.lost.append(jid)
                res.why.append(f"{jid}: accepted but not stored")
                continue
            attempts = store.attempts.of_job(jid)
            res.attempts += len(attempts)
            if job.status not in TERMINAL:
                res.lost.append(jid)
                res.why.append(f"{jid}: still {job.status} (attempt {job.attempt})")
                continue
            numbers = {a.number for a in attempts}
            mine = sorted(
                (info for sid, info in ray_jobs.items() if sid.startswith(f"{jid}-a")),
                key=lambda i: i.start_time or 0,
            )
            stray = [
                i.submission_id
                for i in mine
                if int(i.submission_id.rsplit("-a", 1)[1]) not in numbers
            ]
            overlap = [
                (a.submission_id, b.submission_id)
                for a, b in itertools.pairwise(mine)
                if a.end_time is None or (b.start_time or 0) < a.end_time - 500
            ]
            if stray or overlap:
                res.duplicated.append(jid)
                res.why.append(f"{jid}: Ray ran {stray or overlap} beside the store's attempts")
            steps_seen = [p.step for p in store.events.metric_points(jid)]
            if job.status != "succeeded":
                res.wrong_state.append(jid)
                res.why.append(f"{jid}: {job.status}: {job.error}")
            elif steps_seen[-1:] != [steps] or steps_seen != list(range(steps_seen[0], steps + 1)):
                # every step once (step 0 is the evaluation before training, with a
                # validation file)
                res.wrong_state.append(jid)
                res.why.append(f"{jid}: metric steps {steps_seen}")
    finally:
        store.close()
    return res


def _examples(steps: int) -> int:
    return max(48, math.ceil(steps * BATCH / MAX_EPOCHS))


def _one_db(
    db: str,
    *,
    jobs: int,
    steps: int,
    faults: int,
    outage_s: float,
    seed: int,
    timeout_s: float,
    kinds: tuple[str, ...],
    console: Console,
) -> _Result:
    import httpx

    from service.tools.pg_local import PgServer

    root = Path(tempfile.mkdtemp(prefix=f"pstar-faults-{db}-"))
    pg = None
    serve = None
    poller = None
    rng = random.Random(seed)

    def say(msg: str) -> None:
        console.print(f"[dim]{db} {time.monotonic() - t0:6.1f} s[/] {msg}")

    t0 = time.monotonic()
    try:
        env = {}
        if db == "postgres":
            pg = PgServer.start(root / "pg")
            env["PSTAR_DB_URL"] = pg.url
        data_dir = root / "data"
        data_dir.mkdir()
        serve = ServeProcess(data_dir, f"bench:{TOKEN}", env)
        serve.env.pop("PSTAR_CRASH_AT", None)  # crashes come from the bench, not inherited
        serve.start()
        say("control plane up")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=serve.url, headers=headers, timeout=60) as http:
            up = http.post(
                "/v1/files",
                # enough examples that `steps` fit in at most 50 epochs of 8 a step
                files={"file": ("train.jsonl", io.BytesIO(chat_jsonl(_examples(steps))))},
                data={"purpose": "fine-tune"},
            )
            _ok(up)
            body = {
                "model": MODEL,
                "training_file": up.json()["id"],
                "seed": 7,
                # padded rows of 128 tokens, 8 a step: long enough a step that the
                # schedule's faults land while the jobs train (packed, the examples would
                # fill fewer rows and `steps` would no longer fit the epochs)
                "hyperparameters": {
                    "n_epochs": MAX_EPOCHS,
                    "batch_size": BATCH,
                    "seq_len": 128,
                    "max_steps": steps,
                    "packing": False,
                },
                "resources": {"num_workers": 1},
                "engine": {"dtype": "fp32"},
                "checkpoint_every": max(1, steps // 4),
                "max_attempts": MAX_ATTEMPTS,
            }
            ids = []
            for _ in range(jobs):
                r = http.post("/v1/fine_tuning/jobs", json=body)
                _ok(r)
                ids.append(r.json()["id"])
            ray_url = http.get("/readyz").json().get("ray_dashboard_url")
        say(f"{jobs} jobs created")
        poller = _Poller(serve.url, ids)
        poller.start()
        # the kinds in a random order, cycled: a run of len(kinds) faults has each once
        order = rng.sample(list(kinds), len(kinds))
        if pg is None:
            order = [k for k in order if k != "store"]
        kills: dict[str, int] = {}
        done_faults: dict[str, int] = {}
        ready_s: list[float] = []
        deadline = t0 + timeout_s
        # the first fault once a job trains: before that there is nothing to lose
        while time.monotonic() < deadline:
            with (
                httpx.Client(base_url=serve.url, headers=headers, timeout=30) as http,
                contextlib.suppress(httpx.HTTPError),
            ):
                if any(v["status"] == "running" for v in _jobs_now(http, ids).values()):
                    break
            time.sleep(1.0)
        # round robin over the kinds; one that finds nothing to hit (no running driver
        # left to kill) stays owed and comes again after the others; the store goes down
        # once a run
        queue = list(order)
        tries = n = 0
        while queue and n < faults and time.monotonic() < deadline:
            if tries:
                time.sleep(rng.uniform(2.0, 6.0))
            if _all_ended(serve, ids):
                break  # every job ended before the schedule did
            kind = queue.pop(0)
            tries += 1
            if _inject(kind, serve, pg, ids, kills, rng, outage_s, say, ready_s):
                done_faults[kind] = done_faults.get(kind, 0) + 1
                n += 1
                if kind != "store":
                    queue.append(kind)
            else:
                queue.append(kind)
        say(f"{sum(done_faults.values())} faults injected; waiting for the jobs to end")
        while time.monotonic() < deadline and not _all_ended(serve, ids):
            time.sleep(1.0)
        poller.done.set()
        poller.join(timeout=30)
        url = pg.url if pg else f"sqlite:///{data_dir / 'store.db'}"
        res = _check(db, url, ray_url, ids, steps, data_dir / "ray" / "auth_token")
        res.faults, res.ready_s = done_faults, ready_s
        res.wall_s = time.monotonic() - t0
        lat = sorted(poller.latencies_ms)
        if lat:
            res.p50_ms = statistics.median(lat)
            res.p99_ms = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        res.no_server, res.statuses = poller.no_server, dict(poller.statuses)
        say(f"done: {res.lost=} {res.duplicated=} {res.wrong_state=}")
        return res
    finally:
        if poller is not None:
            poller.done.set()
        if serve is not None:
            serve.stop()
        if pg is not None:
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _per_db(r: _Result) -> dict[str, Any]:
    return {
        "db": r.db,
        "jobs": r.jobs,
        "faults": r.faults,
        "attempts": r.attempts,
        "lost": r.lost,
        "duplicated": r.duplicated,
        "wrong_state": r.wrong_state,
        "why": r.why,
        "p50_api_ms": r.p50_ms,
        "p99_api_ms": r.p99_ms,
        "api_no_server": r.no_server,
        "api_statuses": r.statuses,
        "wall_s": round(r.wall_s, 1),
        "control_plane_ready_s": r.ready_s,
    }


def run(
    *,
    jobs: int = 2,
    # a control plane restarted under load takes 10-30 s to answer and an outage 30 s:
    # 150 steps (~1 min) ended before half of 6 faults had landed
    steps: int = 600,
    faults: int = 6,
    db: str = "both",
    outage_s: float = 30.0,
    seed: int = 0,
    timeout_s: float = 1200.0,
    kinds: tuple[str, ...] = KINDS,
    json_out: bool = False,
) -> dict[str, Any]:
    if db not in ("sqlite", "postgres", "both"):
        raise ValueError(f"--db must be sqlite, postgres or both, got {db!r}")
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"--kinds must name some of {', '.join(KINDS)}, got {kinds!r}")
    if jobs < 1 or steps < 4 or faults < 0:
        raise ValueError("--jobs must be at least 1, --steps at least 4, --faults 0 or more")
    console = Console(stderr=json_out)
    dbs = ["sqlite", "postgres"] if db == "both" else [db]
    load_before = load_avg()
    results = []
    for i, d in enumerate(dbs):
        one = _one_db(
            d, jobs=jobs, steps=steps, faults=faults, outage_s=outage_s, seed=seed + i,
            timeout_s=timeout_s, kinds=tuple(kinds), console=console,
        )  # fmt: skip
        results.append(one)
    table = Table(title=f"Faults: {jobs} jobs x {steps} steps per database, gpt-small, 1 worker")
    for col in ("db", "faults", "attempts", "lost", "duplicated", "wrong state", "API p50/p99 ms",
                "no server", "wall s"):  # fmt: skip
        table.add_column(col)
    for r in results:
        table.add_row(
            r.db,
            ", ".join(f"{k} {n}" for k, n in sorted(r.faults.items())) or "none",
            str(r.attempts),
            str(len(r.lost)),
            str(len(r.duplicated)),
            str(len(r.wrong_state)),
            f"{r.p50_ms or 0:.1f} / {r.p99_ms or 0:.1f}",
            str(r.no_server),
            f"{r.wall_s:.0f}",
        )
    console.print(table)
    for r in results:
        for why in r.why:
            console.print(f"[red]{r.db}: {why}[/]")
    p99s = [r.p99_ms for r in results if r.p99_ms is not None]
    out = {
        "bench": "faults",
        "dbs": dbs,
        "per_db": [_per_db(r) for r in results],
        **machine("fp32"),
        "load_before": load_before,
        "jobs": sum(r.jobs for r in results),
        "faults": sum(sum(r.faults.values()) for r in results),
        "lost": sum(len(r.lost) for r in results),
        "duplicated": sum(len(r.duplicated) for r in results),
        "wrong_state": sum(len(r.wrong_state) for r in results),
        "p99_api_ms_during_faults": max(p99s) if p99s else None,
    }
    load_after = load_avg()
    out["load_after"] = load_after
    return finish(console, out, load_before, load_after, json_out)
