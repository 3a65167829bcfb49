"""API benchmark: latency and requests/s of job create, get and list under 50 clients.

What runs
- The real app (`api.app.create_app` with the reconciler at its production interval of
  1 s and a `DryLauncher`: every job is validated, queued and "submitted", but no Ray job
  starts) on uvicorn, one worker, in a separate process, so the load generator does not
  share its GIL; on 127.0.0.1. The store is SQLite (a file in a temp dir) and/or a
  throw-away PostgreSQL (`service.tools.pg_local`, fsync off: it is thrown away).
- `clients` asyncio clients in this process, each with its own keep-alive connection
  (httpx); client i is tenant i % 5. Each request is create, get or list in the ratio
  1:2:1 (drawn at random per request): create = POST /v1/fine_tuning/jobs with
  `{"model": "gpt-tiny", "training_file": <the tenant's file>}`; get = GET of a random
  job of the tenant; list = GET /v1/fine_tuning/jobs (newest 20).

What "50 concurrent clients" means here
On 2 cores a closed loop of 50 clients without think time measures queueing, not
service: every client sends again the moment it has its answer, so ~50 requests always
wait and latency = 50 / throughput (Little's law). So two runs per database:
- paced (the headline): each client sends at random (Poisson) times at `rate / clients`
  requests/s, so the offered load is `rate` requests/s in all (default 100, below
  saturation), with at most one request in flight per client (a late answer delays that
  client's next send). Latency runs from the *scheduled* send time, so a slow answer that
  holds back the next send is not hidden (the "coordinated omission" correction); the
  time from the actual send is reported beside it as `service` latency.
- saturation: the same clients in a closed loop with no think time. Its requests/s is
  the server's capacity; its latency is mostly queueing and is shown only as that.

Noise: the databases are measured in `rounds` interleaved segments (order alternating,
A B B A ...), each segment one server process (paced, then saturation, after a short
warm-up); only the measured database's server runs, so an idle server's reconciler does
not take CPU from the other. Per database the samples of all rounds are pooled; the
postgres ÷ sqlite ratios are paired per round, median over rounds. Server CPU per
request (from /proc: the app's process, reconciler included; for PostgreSQL also its
server processes) is less sensitive to other load on the machine than wall time; the
load generator's own CPU is reported too (on 2 cores it competes with the server), and
the load average and Linux's CPU pressure around the run.

Growth: with the dry launcher every job stays `queued` for good, and the reconciler
visits every unfinished job on every tick, so its work grows with the jobs created so
far (thousands after a default run). The store keeps its rows across rounds (both
databases grow alike); the table says how many jobs there were when each round began.

Exactly once: every create answered 200 with an id is remembered; after the runs the
store is read directly. `lost` = accepted ids not stored exactly once (or answered
twice); `unacknowledged` = stored jobs that no client was told about (a create that
failed or timed out on the client but committed).

    pstar bench api --json
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish

__all__ = ["run", "serve_main"]

OPS = ("create", "get", "list")
MIX = (1, 2, 1)  # create : get : list
TENANTS = 5
MODEL = "gpt-tiny"  # a zoo model: no model directory needed
GOAL_P99_MS = 50.0
PACED, SATURATION = "paced", "saturation"
_WARMUP_S = 1.5
_TIMEOUT_S = 30.0


def _tokens() -> dict[str, str]:
    """token -> tenant; fixed strings: the server lives on loopback for one benchmark."""
    return {f"tok-bench-{i:02d}-0123456789": f"bench-{i:02d}" for i in range(TENANTS)}


def chat_jsonl(n: int = 16) -> bytes:
    """`n` small chat examples as a JSONL upload (the benchmarks' training file)."""
    words = ("apple", "river", "stone", "light", "music", "garden", "winter", "paper")
    lines = []
    for i in range(n):
        w = words[i % len(words)]
        msgs = [
            {"role": "user", "content": f"What does {w} mean?"},
            {"role": "assistant", "content": f"{w} is a word about {w} things."},
        ]
        lines.append(json.dumps({"messages": msgs}))
    return ("\n".join(lines) + "\n").encode()


# -- the server process ------------------------------------------------------------------


def serve_main(argv: Sequence[str] | None = None) -> None:
    """The server process: `DATA_DIR DB_URL RECONCILE_INTERVAL_S`. Binds a free port on
    127.0.0.1, writes it to DATA_DIR/port, and serves until SIGTERM/SIGINT."""
    import socket

    import uvicorn

    from api.app import create_app
    from service.control.launcher import DryLauncher
    from service.settings import Limits, Settings
    from service.store import Store

    data_dir, db_url, interval = argv if argv is not None else sys.argv[1:]
    interval_s = float(interval)
    # the tenants' quotas would refuse the thousands of creates this load makes (it
    # measures the request path, not the limits); the running limits stay the defaults
    settings = Settings(
        data_dir=Path(data_dir),
        db_url=db_url,
        tokens=_tokens(),
        limits=Limits(max_unfinished_jobs_per_tenant=10**9),
    )
    settings.ensure_dirs()
    store = Store(db_url)
    store.migrate()
    app = create_app(
        settings,
        store,
        DryLauncher(),
        reconcile=interval_s > 0,
        reconcile_interval_s=interval_s or 1.0,
    )
    # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY only on sockets whose proto
    # says TCP, and without it every response written in two pieces waits for the client's
    # delayed ACK (~40 ms). uvicorn's own `host`/`port` binding gets this right.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port_file = Path(data_dir) / "port"
    port_file.with_suffix(".tmp").write_text(str(sock.getsockname()[1]))
    port_file.with_suffix(".tmp").rename(port_file)
    config = uvicorn.Config(app, log_level="warning", access_log=False, backlog=1024)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        store.close()


@dataclass
class _Database:
    """One store under test, kept across rounds: its URL, data dir, the tenants' training
    files, every job id a create was answered with (per tenant), and the accepted ids."""

    name: str
    url: str
    data_dir: Path
    pg: Any = None  # service.tools.pg_local.PgServer for postgres
    files: dict[str, str] = field(default_factory=dict)  # tenant -> file id
    jobs: dict[str, list[str]] = field(default_factory=dict)  # tenant -> job ids
    accepted: list[str] = field(default_factory=list)

    def db_pids(self) -> list[int]:
        """The PostgreSQL server's processes (postmaster and backends), to count their CPU."""
        if self.pg is None:
            return []
        import psutil

        with contextlib.suppress(psutil.Error):
            main = psutil.Process(self.pg.pid)
            return [main.pid, *(c.pid for c in main.children(recursive=True))]
        return []


@contextlib.contextmanager
def _server(db: _Database, reconcile_interval_s: float) -> Iterator[tuple[str, int]]:
    """Start the app in its own process on `db`; yield (base URL, pid); stop it by pid."""
    port_file = db.data_dir / "port"
    port_file.unlink(missing_ok=True)
    log = (db.data_dir / "server.log").open("ab")
    cmd = [
        sys.executable,
        "-c",
        "import sys; from benchmarks.api import serve_main; serve_main(sys.argv[1:])",
        str(db.data_dir),
        db.url,
        str(reconcile_interval_s),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = _wait_ready(proc, port_file, db.data_dir / "server.log")
        yield base, proc.pid
    finally:
        proc.terminate()  # uvicorn shuts down on SIGTERM: lifespan end stops the reconciler
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _wait_ready(proc: subprocess.Popen, port_file: Path, log: Path, timeout: float = 120) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API server exited ({proc.returncode}):\n{log.read_text()}")
        if port_file.exists():
            base = f"http://127.0.0.1:{port_file.read_text().strip()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    return base
        time.sleep(0.05)
    raise RuntimeError(f"the API server did not answer in {timeout:.0f} s:\n{log.read_text()}")


def _cpu_pressure() -> float | None:
    """The share of the last 60 s in which some runnable task waited for a CPU (Linux PSI),
    in percent; None where the kernel does not report it."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(kv.split("=") for kv in first.split()[1:])
    return float(fields["avg60"])


def _cpu_s(pids: Sequence[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
    return out


def _cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds of the processes alive at both readings."""
    return sum(after[p] - before[p] for p in before.keys() & after.keys())


# -- the load ----------------------------------------------------------------------------


@dataclass
class _Load:
    """One stretch of load: every request's (op, status, latency from the scheduled send,
    latency from the actual send), and CPU seconds from the first send to the last answer."""

    samples: list[tuple[str, int, float, float]]
    errors: collections.Counter
    wall_s: float
    client_cpu_s: float  # this process: the load generator
    server_cpu_s: float  # the app's process, reconciler included
    db_cpu_s: float  # PostgreSQL's processes (0 for SQLite: it runs inside the app)


@dataclass
class _Segment:
    """A measured load on one database in one mode and round."""

    db: str
    mode: str
    round: int
    jobs_before: int
    load: _Load

    @property
    def samples(self) -> list[tuple[str, int, float, float]]:
        return self.load.samples


async def _client(
    http: Any,
    db: _Database,
    tenant: str,
    rng: random.Random,
    rate: float | None,
    t0: float,
    t_end: float,
    out: list[tuple[str, int, float, float]],
    errors: collections.Counter,
) -> None:
    """One client: paced (Poisson sends at `rate`/s, one request in flight) or, with
    `rate` None, a closed loop without think time; until `t_end` (perf_counter)."""
    next_t = t0 + (rng.expovariate(rate) if rate else 0.0)
    body = {"model": MODEL, "training_file": db.files[tenant]}
    ids = db.jobs[tenant]
    while True:
        now = time.perf_counter()
        if rate:
            if next_t >= t_end:
                return
            if next_t > now:
                await asyncio.sleep(next_t - now)
            start = next_t
        else:
            if now >= t_end:
                return
            start = now
        op = rng.choices(OPS, MIX)[0]
        sent = time.perf_counter()
        status = 0
        try:
            if op == "create":
                r = await http.post("/v1/fine_tuning/jobs", json=body)
            elif op == "get":
                r = await http.get(f"/v1/fine_tuning/jobs/{rng.choice(ids)}")
            else:
                r = await http.get("/v1/fine_tuning/jobs", params={"limit": 20})
            status = r.status_code
            if op == "create" and status == 200:
                job_id = r.json()["id"]
                db.accepted.append(job_id)
                ids.append(job_id)
        except Exception as e:  # a timeout or a dropped connection is a result, not a crash
            errors[f"{op}: {type(e).__name__}"] += 1
        done = time.perf_counter()
        if status != 200 and status:
            errors[f"{op}: HTTP {status}"] += 1
        out.append((op, status, done - start, done - sent))
        if rate:
            next_t += rng.expovariate(rate)


async def _load(
    base: str,
    db: _Database,
    clients: int,
    seconds: float,
    rate: float | None,
    seed: int,
    server_pid: int = 0,
) -> _Load:
    """Run `clients` clients for `seconds` (paced at `rate` in all, or closed-loop)."""
    import httpx

    tokens = {tenant: tok for tok, tenant in _tokens().items()}
    tenants = sorted(tokens)
    samples: list[tuple[str, int, float, float]] = []
    errors: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    https = [
        httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"Bearer {tokens[tenants[i % TENANTS]]}"},
            timeout=_TIMEOUT_S,
            limits=limits,
            verify=False,  # plain HTTP on loopback; a verifying client loads the CAs (~20 ms)
        )
        for i in range(clients)
    ]
    try:
        # open every connection before the clock starts
        await asyncio.gather(*(h.get("/healthz") for h in https))
        per_client = rate / clients if rate else None
        db_pids = db.db_pids()
        s0, d0 = _cpu_s([server_pid] if server_pid else []), _cpu_s(db_pids)
        t0, c0 = time.perf_counter(), time.process_time()
        t_end = t0 + seconds
        await asyncio.gather(
            *(
                _client(
                    h,
                    db,
                    tenants[i % TENANTS],
                    random.Random(seed * 1000 + i),
                    per_client,
                    t0,
                    t_end,
                    samples,
                    errors,
                )
                for i, h in enumerate(https)
            )
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s1, d1 = _cpu_s(list(s0)), _cpu_s(db_pids)
    finally:
        await asyncio.gather(*(h.aclose() for h in https))
    return _Load(samples, errors, wall, cpu, _cpu_delta(s0, s1), _cpu_delta(d0, d1))


async def _prepare(base: str, db: _Database) -> None:
    """Each tenant's training file (first time), and one create per tenant, sequentially:
    the first create of a fresh server imports the model zoo (and torch)."""
    import httpx

    data = chat_jsonl()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        for tok, tenant in _tokens().items():
            auth = {"Authorization": f"Bearer {tok}"}
            if tenant not in db.files:
                r = await http.post(
                    "/v1/files",
                    headers=auth,
                    files={"file": ("train.jsonl", data, "application/jsonl")},
                    data={"purpose": "fine-tune"},
                )
                r.raise_for_status()
                db.files[tenant] = r.json()["id"]
                db.jobs[tenant] = []
            r = await http.post(
                "/v1/fine_tuning/jobs",
                headers=auth,
                json={"model": MODEL, "training_file": db.files[tenant]},
            )
            r.raise_for_status()
            db.accepted.append(r.json()["id"])
            db.jobs[tenant].append(r.json()["id"])


def _job_count(url: str) -> int:
    from service.store import Store

    store = Store(url)
    try:
        return sum(store.jobs.count_by_status().values())
    finally:
        store.close()


def _segments_on(
    db: _Database,
    rnd: int,
    modes: Sequence[tuple[str, float]],
    clients: int,
    rate: float,
    reconcile_interval_s: float,
    profile_dir: Path | None,
) -> list[_Segment]:
    """Start the server on `db`, warm up, and run each (mode, seconds); stop the server."""
    out = []
    with _server(db, reconcile_interval_s) as (base, pid):
        asyncio.run(_prepare(base, db))
        asyncio.run(_load(base, db, clients, _WARMUP_S, rate, seed=10_000 + rnd))
        for mode, seconds in modes:
            jobs_before = _job_count(db.url)
            spy = _start_profile(profile_dir, db.name, mode, rnd, pid, seconds)
            seed = rnd * 2 + (mode == SATURATION)
            paced_rate = rate if mode == PACED else None
            load = asyncio.run(_load(base, db, clients, seconds, paced_rate, seed, pid))
            if spy is not None:
                spy.wait(timeout=seconds + 60)
            out.append(_Segment(db.name, mode, rnd, jobs_before, load))
    return out


def _start_profile(
    profile_dir: Path | None, db: str, mode: str, rnd: int, pid: int, seconds: float
) -> subprocess.Popen | None:
    """py-spy on the server for the segment (collapsed stacks, all threads, idle excluded)."""
    if profile_dir is None:
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    profile_dir.mkdir(parents=True, exist_ok=True)
    out = profile_dir / f"{db}-{mode}-r{rnd}.txt"
    cmd = [spy, "record", "--pid", str(pid), "--duration", str(math.ceil(seconds))]
    cmd += ["--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- numbers -----------------------------------------------------------------------------


def _pct(sorted_xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of sorted values (NaN when empty)."""
    if not sorted_xs:
        return float("nan")
    return sorted_xs[max(0, math.ceil(q * len(sorted_xs)) - 1)]


def _latency(samples: Sequence[tuple[str, int, float, float]]) -> dict[str, Any]:
    lat = sorted(s[2] for s in samples)
    svc = sorted(s[3] for s in samples)
    return {
        "requests": len(samples),
        "errors": sum(1 for s in samples if s[1] != 200),
        "p50_ms": 1e3 * _pct(lat, 0.50),
        "p90_ms": 1e3 * _pct(lat, 0.90),
        "p99_ms": 1e3 * _pct(lat, 0.99),
        "max_ms": 1e3 * lat[-1] if lat else float("nan"),
        "service_p50_ms": 1e3 * _pct(svc, 0.50),
        "service_p99_ms": 1e3 * _pct(svc, 0.99),
    }


def _summary(segs: Sequence[_Segment]) -> dict[str, Any]:
    """Pooled numbers of one database's segments of one mode, and each round's."""
    samples = [s for seg in segs for s in seg.samples]
    wall = sum(seg.load.wall_s for seg in segs)
    n = len(samples)
    res = _latency(samples)
    res.update(
        rps=n / wall if wall else 0.0,
        seconds=wall,
        server_cpu_ms_per_req=1e3 * sum(g.load.server_cpu_s for g in segs) / max(n, 1),
        db_cpu_ms_per_req=1e3 * sum(g.load.db_cpu_s for g in segs) / max(n, 1),
        client_cpu_ms_per_req=1e3 * sum(g.load.client_cpu_s for g in segs) / max(n, 1),
        by_op={op: _latency([s for s in samples if s[0] == op]) for op in OPS},
        errors_by_kind=dict(sum((g.load.errors for g in segs), collections.Counter())),
        rounds=[
            {
                "round": g.round,
                "jobs_before": g.jobs_before,
                "rps": len(g.samples) / g.load.wall_s if g.load.wall_s else 0.0,
                **{k: v for k, v in _latency(g.samples).items() if k.endswith("_ms")},
            }
            for g in segs
        ],
    )
    return res


def _check_stored(db: _Database) -> dict[str, int]:
    """Read the store directly: accepted creates stored exactly once, and extra rows."""
    from sqlalchemy import func, select

    from service.store import Job, Store

    store = Store(db.url)
    try:
        with store.db.read() as s:
            stored = collections.Counter(s.scalars(select(Job.id)))
            total = s.scalar(select(func.count()).select_from(Job))
    finally:
        store.close()
    answered = collections.Counter(db.accepted)
    lost = sum(1 for jid, n in answered.items() if n != 1 or stored.get(jid, 0) != 1)
    return {
        "accepted": len(db.accepted),
        "stored": int(total or 0),
        "lost": lost,
        "unacknowledged": sum(1 for jid in stored if jid not in answered),
    }


def _ratios(segs: Sequence[_Segment], mode: str) -> dict[str, Any] | None:
    """postgres ÷ sqlite per round (p50, p99, rps, server CPU per request); medians."""
    by = {(g.db, g.round): g for g in segs if g.mode == mode}
    rounds = sorted({r for _, r in by})
    pairs = [(by[("sqlite", r)], by[("postgres", r)]) for r in rounds if ("postgres", r) in by]
    if not pairs:
        return None

    def one(g: _Segment) -> dict[str, float]:
        lat = _latency(g.samples)
        return {
            "p50": lat["p50_ms"],
            "p99": lat["p99_ms"],
            "rps": len(g.samples) / g.load.wall_s,
            "cpu": (g.load.server_cpu_s + g.load.db_cpu_s) / max(len(g.samples), 1),
        }

    per = []
    for a, b in pairs:
        x, y = one(a), one(b)
        per.append({k: y[k] / x[k] if x[k] else float("nan") for k in x})
    return {k: statistics.median(p[k] for p in per) for k in per[0]} | {"per_round": per}


# -- the benchmark -----------------------------------------------------------------------


def run(
    seconds: float = 20.0,
    clients: int = 50,
    db: str = "both",
    rate: float = 100.0,
    saturation_seconds: float = 10.0,
    rounds: int = 2,
    json_out: bool = False,
    reconcile_interval_s: float = 1.0,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure the job routes on `db` (sqlite, postgres or both); print the tables; return
    (and with `json_out` print last, as one line) the numbers.

    `seconds` of paced load at `rate` requests/s in all and `saturation_seconds` of
    closed-loop load per database, each split over `rounds` interleaved segments.
    Headline keys (`p50_ms`, `p99_ms`, `rps`, `lost`, `db`) are SQLite's paced run (or
    PostgreSQL's when only it runs); `results` holds every database's numbers.
    `reconcile_interval_s` 0 runs without the reconciler (for diagnosis); `profile_dir`
    records the server with py-spy during every segment.
    """
    if db not in ("sqlite", "postgres", "both"):
        raise ValueError(f"db must be sqlite, postgres or both, got {db!r}")
    if seconds <= 0 or saturation_seconds < 0 or clients < 1 or rounds < 1 or rate <= 0:
        raise ValueError("need seconds > 0, saturation_seconds >= 0, clients, rounds, rate > 0")
    from service.tools.pg_local import PgServer, find_pg_bindir

    names = ["sqlite", "postgres"] if db == "both" else [db]
    note = ""
    if "postgres" in names and find_pg_bindir() is None:
        if db == "postgres":
            raise RuntimeError("PostgreSQL server binaries (initdb) not found: install postgresql")
        names, note = ["sqlite"], "PostgreSQL binaries not found: SQLite only. "
    modes = [(PACED, seconds / rounds)]
    if saturation_seconds > 0:
        modes.append((SATURATION, saturation_seconds / rounds))

    root = Path(tempfile.mkdtemp(prefix="pstar-bench-api-"))
    dbs: dict[str, _Database] = {}
    segs: list[_Segment] = []
    try:
        for name in names:
            data_dir = root / name
            data_dir.mkdir()
            if name == "sqlite":
                dbs[name] = _Database(name, f"sqlite:///{data_dir / 'store.db'}", data_dir)
            else:
                pg = PgServer.start(root)
                dbs[name] = _Database(name, pg.url, data_dir, pg=pg)
        load_before, psi_before = os.getloadavg(), _cpu_pressure()
        for rnd in range(rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                segs += _segments_on(
                    dbs[name], rnd, modes, clients, rate, reconcile_interval_s, profile_dir
                )
        load_after, psi_after = os.getloadavg(), _cpu_pressure()
        stored = {name: _check_stored(d) for name, d in dbs.items()}
    finally:
        for d in dbs.values():
            if d.pg is not None:
                d.pg.stop()
        shutil.rmtree(root, ignore_errors=True)

    results: dict[str, Any] = {}
    for name in names:
        results[name] = {
            mode: _summary([g for g in segs if g.db == name and g.mode == mode])
            for mode, _ in modes
        } | {"store": stored[name]}
    head = names[0]
    paced = results[head][PACED]
    from pstar_core.precision import cpu_capability

    result: dict[str, Any] = {
        "p50_ms": paced["p50_ms"],
        "p99_ms": paced["p99_ms"],
        "rps": paced["rps"],
        "lost": stored[head]["lost"],
        "db": head,
        "errors": paced["errors"],
        "saturation_rps": results[head].get(SATURATION, {}).get("rps"),
        # the app's process (reconciler included) per request of the paced run
        "server_cpu_ms_per_req": paced["server_cpu_ms_per_req"],
        "cpu_capability": cpu_capability(),
        "goal": {"p99_ms_below": GOAL_P99_MS, "lost": 0},
        "goal_met": paced["p99_ms"] < GOAL_P99_MS and stored[head]["lost"] == 0,
        "clients": clients,
        "rate": rate,
        "seconds": seconds,
        "saturation_seconds": saturation_seconds,
        "rounds": rounds,
        "mix": dict(zip(OPS, MIX, strict=True)),
        "reconcile_interval_s": reconcile_interval_s,
        "results": results,
        "postgres_over_sqlite": {mode: _ratios(segs, mode) for mode, _ in modes}
        if len(names) == 2
        else None,
        "note": note.strip() or None,
        "load_avg": {"before": list(load_before), "after": list(load_after)},
        "cpu_pressure_avg60_pct": {"before": psi_before, "after": psi_after},
    }
    console = Console(width=max(Console().width, 150))
    for name in names:
        console.print(_table(name, results[name], modes, clients, rate))
    if len(names) == 2:
        console.print(_ratio_table(result["postgres_over_sqlite"]))
    verdict = "met" if result["goal_met"] else "NOT met"
    console.print(
        f"goal p99 < {GOAL_P99_MS:.0f} ms with 0 lost on {head} (paced, {rate:g} req/s): "
        f"{verdict} (p99 {paced['p99_ms']:.1f} ms, lost {stored[head]['lost']})"
    )
    if psi_before is not None and psi_after is not None:
        note += f"cpu pressure (some, avg60) before {psi_before:.0f}%, after {psi_after:.0f}%; "
    return finish(console, result, load_before, load_after, json_out, note)


def _table(
    name: str, res: dict[str, Any], modes: Sequence[tuple[str, float]], clients: int, rate: float
) -> Table:
    st = res["store"]
    client_cpu = ", ".join(f"{m} {res[m]['client_cpu_ms_per_req']:.2f}" for m, _ in modes)
    caption = [
        f"paced: Poisson sends at {rate:g} req/s in all, at most one in flight per client; "
        "latency from the scheduled send (svc: from the actual send)",
        "saturation: closed loop without think time: its req/s is the capacity, its latency "
        "mostly queueing",
        f"store: {st['accepted']} creates accepted, {st['stored']} stored, lost {st['lost']}, "
        f"unacknowledged {st['unacknowledged']}",
        "paced rounds: jobs in the store at the start (all stay queued; the reconciler visits "
        "each every tick) -> p99: "
        + ", ".join(f"{r['jobs_before']} -> {r['p99_ms']:.1f} ms" for r in res[PACED]["rounds"]),
        f"load generator cpu ms/req (this process): {client_cpu}",
    ]
    table = Table(
        title=f"pstar API on {name}: {clients} clients, create:get:list {':'.join(map(str, MIX))}",
        caption="\n".join(caption),
        caption_justify="left",
    )
    cols = ("run", "op", "requests", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms")
    cols += ("svc p99 ms", "errors", "server cpu ms/req", "db cpu ms/req")
    for col in cols:
        table.add_column(col, justify="left" if col in ("run", "op") else "right")
    for mode, _ in modes:
        r = res[mode]
        rows = [("all", r)] + ([(op, r["by_op"][op]) for op in OPS] if mode == PACED else [])
        for op, x in rows:
            whole = op == "all"
            table.add_row(
                mode if whole else "",
                op,
                str(x["requests"]),
                f"{r['rps']:.1f}" if whole else f"{x['requests'] / r['seconds']:.1f}",
                f"{x['p50_ms']:.1f}",
                f"{x['p90_ms']:.1f}",
                f"{x['p99_ms']:.1f}",
                f"{x['max_ms']:.1f}",
                f"{x['service_p99_ms']:.1f}",
                str(x["errors"]),
                f"{r['server_cpu_ms_per_req']:.2f}" if whole else "",
                f"{r['db_cpu_ms_per_req']:.2f}" if whole and name == "postgres" else "",
            )
    return table


def _ratio_table(ratios: dict[str, Any]) -> Table:
    table = Table(title="postgres ÷ sqlite (paired per round, median)")
    for col in ("run", "p50", "p99", "req/s", "cpu/req (app + db)"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for mode, r in ratios.items():
        if r is not None:
            table.add_row(mode, *(f"{r[k]:.2f}" for k in ("p50", "p99", "rps", "cpu")))
    return table


if __name__ == "__main__":
    run(json_out=True)
