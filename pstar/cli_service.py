"""The service's commands: `pstar serve`, `pstar files ...`, `pstar jobs ...`, `pstar run`.

All but `serve` talk HTTP to `--url` (default the local server) with the token from
`PSTAR_API_TOKEN` or the one `pstar serve` keeps in its data dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from pstar.client import DEFAULT_URL, ApiError, Client, find_token
from service.store.status import TERMINAL

console = Console()
files_app = typer.Typer(pretty_exceptions_show_locals=False, help="Training files on the service.")
jobs_app = typer.Typer(pretty_exceptions_show_locals=False, help="Fine-tuning jobs on the service.")
keys_app = typer.Typer(
    pretty_exceptions_show_locals=False,
    help="API keys, in the service's store (PSTAR_DB_URL / PSTAR_DATA_DIR), for the operator.",
)

Url = Annotated[str, typer.Option(envvar="PSTAR_URL", help="the service's base URL")]
DataDir = Annotated[
    Path | None,
    typer.Option(envvar="PSTAR_DATA_DIR", help="where `pstar serve` keeps its token (and data)"),
]


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(code)


def _client(url: str, data_dir: Path | None) -> Client:
    c = Client(url, find_token(data_dir))
    if not c.healthy():
        _fail(f"no service answers at {url}; start one with `pstar serve` (or set --url)")
    return c


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ApiError as e:
        _fail(e.message)


# -- serve ------------------------------------------------------------------------------


def serve(
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    ray_cpus: Annotated[
        int | None, typer.Option(help="CPUs of the local Ray head (default: all)")
    ] = None,
    dashboard_port: Annotated[
        int | None, typer.Option(help="port of the local Ray dashboard (default: a free one)")
    ] = None,
    keep_ray: Annotated[
        bool, typer.Option(help="leave the local Ray head (and its jobs) running on exit")
    ] = False,
) -> None:
    """Run the control plane: the API, the store, the reconciler, and (with no RAY_ADDRESS)
    a local Ray head with its dashboard."""
    import logging

    from pstar.server import ListenError
    from pstar.server import serve as run_server
    from service.control.control_plane import token_file
    from service.settings import Settings, SettingsError, redacted

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "alembic", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # where jobs' workers reach this API (score_model graders), unless the operator said
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    reach = f"[{reach}]" if ":" in reach else reach  # an IPv6 address, in brackets
    env = dict(os.environ)  # this process's own is left as it was
    env.setdefault("PSTAR_API_URL", f"http://{reach}:{port}")
    try:
        settings = Settings.from_env(env)
    except SettingsError as e:
        _fail(str(e))

    def ready(s, launcher, head) -> None:
        console.print(f"[bold]PatrickStar Service[/bold] on http://{host}:{port}/v1 (docs: /docs)")
        console.print(f"data dir {s.data_dir}; store {redacted(s.db_url)}")
        if not os.environ.get("PSTAR_API_TOKENS"):
            console.print(f"API token for tenant 'default' in {token_file(s)}")
        where = "local head" if head is not None else "cluster"
        console.print(f"Ray {where}: dashboard {launcher.dashboard_url}")

    try:
        run_server(settings, host, port, ray_cpus, dashboard_port, keep_ray, on_ready=ready)
    except (SettingsError, ListenError) as e:  # SettingsError: a deployment that would lose
        _fail(str(e))  # jobs (service.control.preflight)


# -- files ------------------------------------------------------------------------------


@files_app.command("upload")
def files_upload(path: Path, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Upload a training file (JSONL chat, prompt/completion, text; or plain text)."""
    if not path.is_file():
        _fail(f"{path} is not a file")
    f = _call(_client(url, data_dir).upload, path)
    console.print(
        f"{f['id']}: {f['filename']}, {f['examples']} {f['format']} examples, {f['bytes']:,} bytes"
    )


@files_app.command("list")
def files_list(url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Your files."""
    page = _call(_client(url, data_dir).get, "/v1/files")
    t = Table()
    for col in ("id", "filename", "purpose", "format", "examples", "bytes", "created"):
        t.add_column(col)
    for f in page["data"]:
        t.add_row(
            f["id"],
            f["filename"],
            f["purpose"],
            f["format"],
            str(f["examples"]),
            f"{f['bytes']:,}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(f["created_at"])),
        )
    console.print(t)


# -- jobs -------------------------------------------------------------------------------


def load_spec(path: Path) -> dict[str, Any]:
    if not path.is_file():
        _fail(f"spec file {path} does not exist")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        _fail(f"{path} is not valid YAML: {e}")
    if not isinstance(spec, dict):
        _fail(f"{path} must hold a mapping (the body of POST /v1/fine_tuning/jobs)")
    return spec


def upload_spec_files(c: Client, spec: dict[str, Any], base: Path) -> dict[str, Any]:
    """Replace `training_file`/`validation_file` paths by the ids of their uploads."""
    body = dict(spec)
    for key in ("training_file", "validation_file"):
        val = body.get(key)
        if not isinstance(val, str):
            continue
        p = Path(val) if Path(val).is_absolute() else base / val
        if p.is_file():
            f = _call(c.upload, p)
            console.print(f"uploaded {p.name}: {f['id']} ({f['examples']} {f['format']} examples)")
            body[key] = f["id"]
        elif not val.startswith("file-"):
            _fail(f"{key}: {p} is not a file (give a path or an uploaded file id)")
    return body


@jobs_app.command("submit")
def jobs_submit(
    spec: Annotated[Path, typer.Argument(help="YAML: the job body; file fields may be paths")],
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
    follow: Annotated[bool, typer.Option(help="follow the job to its end")] = False,
) -> None:
    """Submit a fine-tuning job (file paths in the spec are uploaded first)."""
    c = _client(url, data_dir)
    body = upload_spec_files(c, load_spec(spec), spec.resolve().parent)
    job = _call(c.post, "/v1/fine_tuning/jobs", body)
    console.print(f"{job['id']}: {job['status']} ({job['model']})")
    if follow:
        follow_job(c, job["id"])


@jobs_app.command("validate")
def jobs_validate(spec: Path, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Dry run: data report and memory estimate, nothing stored."""
    c = _client(url, data_dir)
    body = upload_spec_files(c, load_spec(spec), spec.resolve().parent)
    console.print_json(json.dumps(_call(c.post, "/v1/fine_tuning/jobs/validate", body)))


@jobs_app.command("list")
def jobs_list(
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
    status: Annotated[str | None, typer.Option(help="only jobs in this status")] = None,
    limit: int = 20,
) -> None:
    """Your jobs, newest first."""
    page = _call(_client(url, data_dir).get, "/v1/fine_tuning/jobs", status=status, limit=limit)
    t = Table()
    for col in ("id", "model", "status", "detail", "progress", "created", "fine-tuned model"):
        t.add_column(col)
    for j in page["data"]:
        p = j["progress"]
        t.add_row(
            j["id"],
            j["model"],
            j["status"],
            j.get("status_detail") or "",
            f"{p['step']}/{p['total']}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(j["created_at"])),
            j.get("fine_tuned_model") or "",
        )
    console.print(t)


@jobs_app.command("plot-trace")
def jobs_plot_trace(
    job_id: str,
    out: Annotated[Path | None, typer.Option(help="PNG path (default <job id>-trace.png)")] = None,
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
) -> None:
    """A PNG of the job's warm-up tracer timeline: the data its dashboard page plots."""
    from service.tools.plot_trace import memory_stats, plot_trace

    memory = _call(_client(url, data_dir).get, f"/v1/fine_tuning/jobs/{job_id}/memory")
    if not memory.get("available"):
        _fail(f"{job_id} has no trace yet: it appears after the job's first iteration")
    path = plot_trace(memory_stats(memory), out or Path(f"{job_id}-trace.png"), title=job_id)
    console.print(f"wrote {path}")


@jobs_app.command("get")
def jobs_get(job_id: str, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """One job, as JSON."""
    console.print_json(
        json.dumps(_call(_client(url, data_dir).get, f"/v1/fine_tuning/jobs/{job_id}"))
    )


@jobs_app.command("events")
def jobs_events(job_id: str, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """A job's events, oldest first."""
    for e in _call(_client(url, data_dir).events, job_id):
        ts = time.strftime("%H:%M:%S", time.localtime(e["created_at"]))
        style = {"error": "red", "warn": "yellow"}.get(e["level"], "")
        console.print(
            f"[dim]{ts}[/dim] [{style}]{e['message']}[/{style}]"
            if style
            else f"[dim]{ts}[/dim] {e['message']}"
        )


@jobs_app.command("logs")
def jobs_logs(
    job_id: str,
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream until the job ends")
    ] = False,
) -> None:
    """Driver and worker logs of the job's attempts."""
    c = _client(url, data_dir)
    if follow:
        try:
            for chunk in c.stream_logs(job_id):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        except ApiError as e:
            _fail(e.message)
        return
    sys.stdout.write(_call(c.get, f"/v1/fine_tuning/jobs/{job_id}/logs"))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Cancel a job (its Ray job and workers stop)."""
    job = _call(_client(url, data_dir).post, f"/v1/fine_tuning/jobs/{job_id}/cancel")
    console.print(f"{job['id']}: {job['status']}")


@jobs_app.command("pause")
def jobs_pause(job_id: str, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Pause a job: it writes a checkpoint at its next step boundary and frees its workers
    (a queued one leaves the queue at once)."""
    job = _call(_client(url, data_dir).post, f"/v1/fine_tuning/jobs/{job_id}/pause")
    how = " (pausing at the next step boundary)" if job.get("pause_requested") else ""
    console.print(f"{job['id']}: {job['status']}{how}")


@jobs_app.command("resume")
def jobs_resume(job_id: str, url: Url = DEFAULT_URL, data_dir: DataDir = None) -> None:
    """Resume a paused job from its checkpoint."""
    job = _call(_client(url, data_dir).post, f"/v1/fine_tuning/jobs/{job_id}/resume")
    console.print(f"{job['id']}: {job['status']}")


def follow_job(c: Client, job_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """A progress bar until the job ends; events are printed as they come."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    seen: set[str] = set()
    with progress:
        task = progress.add_task("queued", total=None, info="")
        while True:
            job = _call(c.get, f"/v1/fine_tuning/jobs/{job_id}")
            for e in _call(c.events, job_id):
                if e["id"] in seen:
                    continue
                seen.add(e["id"])
                if e["type"] == "message":
                    ts = time.strftime("%H:%M:%S", time.localtime(e["created_at"]))
                    progress.console.print(f"[dim]{ts}[/dim] {e['message']}")
                elif e.get("data", {}).get("train_loss") is not None:
                    d = e["data"]
                    tps = d.get("tokens_per_second", 0)
                    progress.update(task, info=f"loss {d['train_loss']:.3f}  {tps:.0f} tok/s")
            p = job["progress"]
            desc = job["status"] + (
                f" ({job['status_detail']})" if job.get("status_detail") else ""
            )
            progress.update(task, description=desc, completed=p["step"], total=p["total"] or None)
            if job["status"] in TERMINAL:
                return job
            time.sleep(poll_s)


# -- run: the whole thing on one machine ------------------------------------------------


def run(
    spec: Annotated[Path, typer.Argument(help="a job spec YAML (see examples/)")],
    data_dir: Annotated[
        Path, typer.Option(envvar="PSTAR_DATA_DIR", help="the service's data dir")
    ] = Path(".cache/pstar"),
    port: Annotated[int, typer.Option(help="API port of the service it starts")] = 8000,
    keep_serving: Annotated[
        bool, typer.Option(help="leave the service (and local Ray) running afterwards")
    ] = False,
) -> None:
    """Start the control plane (SQLite, local Ray) unless one runs on the port, submit the
    spec through the REST API, follow it to its end, and shut the service down."""
    url = f"http://127.0.0.1:{port}"
    c = Client(url, None)
    proc = None
    job: dict[str, Any] = {"status": "not submitted"}
    if not c.healthy():
        proc = start_server(data_dir, port)
    t0 = time.time()
    try:
        c = Client(url, find_token(data_dir))
        _wait_ready(c, proc, data_dir)
        ray_url = c.http.get("/readyz").json().get("ray_dashboard_url")
        console.print(f"API {url}/v1 (docs {url}/docs); Ray dashboard {ray_url} (Jobs page)")
        body = upload_spec_files(c, load_spec(spec), spec.resolve().parent)
        job = _call(c.post, "/v1/fine_tuning/jobs", body)
        workers = job["resources"]["num_workers"]
        console.print(f"submitted {job['id']} ({job['model']} on {workers} Ray workers)")
        job = follow_job(c, job["id"])
        summarize(c, job, url, time.time() - t0)
    finally:
        if proc is not None and not keep_serving:
            console.print("shutting the service down (and its local Ray head)")
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()
        elif proc is not None:
            console.print(f"the service keeps running (pid {proc.pid}) at {url}/v1")
    if job["status"] != "succeeded":
        raise typer.Exit(1)


def chat(
    model: Annotated[
        str, typer.Argument(help="a base model, a fine-tuned model or a checkpoint's")
    ],
    prompt: Annotated[
        str | None, typer.Option("--prompt", "-p", help="answer this one message and exit")
    ] = None,
    system: Annotated[str | None, typer.Option(help="a system message first")] = None,
    max_tokens: Annotated[int, typer.Option(help="the most tokens an answer has")] = 256,
    temperature: Annotated[float, typer.Option(help="0: greedy (the same answer each time)")] = 0.7,
    seed: Annotated[int | None, typer.Option(help="repeat a sampled answer")] = None,
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
) -> None:
    """Talk to a model served by the service: an interactive prompt (the conversation kept
    until /reset; /exit or Ctrl-D ends it), or one answer with -p."""
    c = _client(url, data_dir)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    params = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed}

    def answer(text: str) -> None:
        history.append({"role": "user", "content": text})
        parts = []
        try:
            for piece in c.chat_stream(model, history, **params):
                parts.append(piece)
                console.out(piece, end="", highlight=False)
        except ApiError as e:
            history.pop()
            if prompt is not None:
                _fail(e.message)
            console.print(f"[red]error:[/red] {e.message}")
            return
        console.out("")
        history.append({"role": "assistant", "content": "".join(parts)})

    if prompt is not None:
        answer(prompt)
        return
    console.print(f"[dim]{model} — /reset forgets the conversation, /exit (or Ctrl-D) ends[/dim]")
    while True:
        try:
            text = input("> ")
        except EOFError:
            console.out("")
            return
        if text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            del history[1 if system else 0 :]
            continue
        if text.strip():
            answer(text)


def _key_store():
    from service.settings import Settings, SettingsError
    from service.store import Store

    try:
        settings = Settings.from_env()
    except SettingsError as e:
        _fail(str(e))
    store = Store(settings.db_url)
    store.migrate()
    return store


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Argument(help="the tenant the key acts as")] = "",
    admin: Annotated[bool, typer.Option("--admin", help="a key that manages keys")] = False,
    name: Annotated[str, typer.Option(help="a label")] = "",
) -> None:
    """Make a key; its secret is printed this once (the store keeps its SHA-256)."""
    from service.settings import TENANT_RE

    if not admin and not TENANT_RE.match(tenant):
        _fail("give the tenant (letters, digits, . _ -; at most 64), or --admin")
    store = _key_store()
    key, secret = store.keys.create(tenant, "admin" if admin else "tenant", name)
    store.close()
    console.print(f"{key.id} ({key.role} of {key.tenant}); the secret, shown once:")
    print(secret)  # plain: for a pipe into a secrets manager


@keys_app.command("list")
def keys_list(tenant: Annotated[str | None, typer.Option(help="one tenant's keys")] = None) -> None:
    """Every key, revoked ones included, without secrets (the last 4 characters only)."""
    store = _key_store()
    t = Table()
    t.add_column("id", no_wrap=True)
    for header in ("tenant", "role", "name", "ends with", "created", "revoked"):
        t.add_column(header)
    for k in store.keys.list(tenant):
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(k.created_at))
        gone = time.strftime("%Y-%m-%d %H:%M", time.gmtime(k.revoked_at)) if k.revoked_at else ""
        t.add_row(k.id, k.tenant, k.role, k.name, k.hint, when, gone)
    store.close()
    console.print(t)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key: a running control plane refuses it within 5 s."""
    store = _key_store()
    key = store.keys.revoke(key_id)
    store.close()
    if key is None:
        _fail(f"no key {key_id}; `pstar keys list` shows them")
    console.print(f"{key.id} ({key.role} of {key.tenant}) revoked")


@keys_app.command("hash")
def keys_hash() -> None:
    """Read a token on standard input and print `sha256:<hex>`, the form PSTAR_API_TOKENS
    takes (`tenant:sha256:<hex>`) so the environment holds no secret."""
    import sys

    from service.store.keys import key_hash

    secret = sys.stdin.readline().strip()
    if len(secret) < 8:
        _fail("give the token on standard input (at least 8 characters)")
    print(f"sha256:{key_hash(secret)}")


def import_openai(
    job_json: Annotated[
        Path, typer.Argument(help="the job as `openai api fine_tuning.jobs.retrieve` prints it")
    ],
    model: Annotated[str, typer.Option(help="the model here to fine-tune (GET /v1/models)")],
    training_file: Annotated[Path, typer.Option(help="the job's training file, exported JSONL")],
    validation_file: Annotated[
        Path | None, typer.Option(help="its validation file, exported JSONL")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option(help="print the request and what was left out; create nothing")
    ] = False,
    follow: Annotated[bool, typer.Option(help="follow the new job to its end")] = False,
    url: Url = DEFAULT_URL,
    data_dir: DataDir = None,
) -> None:
    """Recreate an OpenAI fine-tuning job here: its files uploaded, its method and
    hyperparameters carried over, and what does not map named."""
    from pstar.openai_import import NotAJob, request_of

    try:
        job = json.loads(job_json.read_text())
    except (OSError, ValueError) as e:
        _fail(f"{job_json}: not a JSON file ({e})")
    for p in (training_file, validation_file):
        if p is not None and not p.is_file():
            _fail(f"{p} is not a file (give the exported JSONL)")
    try:
        mapped = request_of(
            job, model, str(training_file), str(validation_file) if validation_file else None
        )
    except NotAJob as e:
        _fail(f"{job_json}: {e}")
    for note in mapped.notes:
        console.print(f"[yellow]note[/]: {note}")
    if dry_run:
        console.print_json(json.dumps(mapped.body))
        return
    c = _client(url, data_dir)
    body = upload_spec_files(c, mapped.body, Path.cwd())
    created = _call(c.post, "/v1/fine_tuning/jobs", body)
    old = job.get("id", "the OpenAI job")
    console.print(f"{created['id']}: {created['status']} ({created['model']}), from {old}")
    if follow:
        follow_job(c, created["id"])


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command("import-openai")(import_openai)
    app.command()(run)
    app.command()(chat)
    app.add_typer(files_app, name="files")
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(keys_app, name="keys")


def start_server(data_dir: Path, port: int) -> subprocess.Popen:
    data_dir.mkdir(parents=True, exist_ok=True)
    log = (data_dir / "serve.log").open("ab")
    env = {**os.environ, "PSTAR_DATA_DIR": str(data_dir.resolve())}
    console.print(f"starting the control plane (SQLite, local Ray); log {data_dir / 'serve.log'}")
    return subprocess.Popen(
        [sys.executable, "-m", "pstar", "serve", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _wait_ready(
    c: Client, proc: subprocess.Popen | None, data_dir: Path, timeout_s: float = 180
) -> None:
    deadline = time.time() + timeout_s
    with console.status("waiting for the control plane and Ray"):
        while time.time() < deadline:
            if proc is not None and proc.poll() is not None:
                _fail(f"the control plane exited with code {proc.returncode}; see its serve.log")
            try:
                r = c.http.get("/readyz", timeout=2)
                if r.status_code == 200:
                    if c.http.headers.get("Authorization") is None:
                        tok = find_token(data_dir)
                        if tok:
                            c.http.headers["Authorization"] = f"Bearer {tok}"
                    return
            except Exception:
                pass
            time.sleep(1)
    _fail(f"the control plane was not ready within {timeout_s:.0f} s")


def summarize(c: Client, job: dict[str, Any], url: str, elapsed_s: float) -> None:
    events = _call(c.events, job["id"])
    before = next(
        (
            e["data"].get("full_valid_loss")
            for e in events
            if e["type"] == "metrics" and e["data"].get("step") == 0
        ),
        None,
    )
    final = [
        c_
        for c_ in _call(c.get, f"/v1/fine_tuning/jobs/{job['id']}/checkpoints")["data"]
        if c_["final"]
    ]
    after = final[0]["metrics"].get("full_valid_loss") if final else None
    health = c.http.get("/readyz").json()
    t = Table(title=f"{job['id']}: {job['status']} in {elapsed_s:.0f} s")
    t.add_column("")
    t.add_column("")
    if before is not None and after is not None:
        t.add_row("held-out loss", f"{before:.4f} -> {after:.4f}")
    t.add_row("fine-tuned model", job.get("fine_tuned_model") or "-")
    if job.get("fine_tuned_model"):
        t.add_row("talk to it", f"pstar chat '{job['fine_tuned_model']}' (with `pstar serve` up)")
    t.add_row("trained tokens", f"{job.get('trained_tokens') or 0:,}")
    if job.get("error"):
        t.add_row("error", job["error"]["message"])
    t.add_row("API", f"{url}/v1 (docs {url}/docs)")
    t.add_row("Ray dashboard", str(health.get("ray_dashboard_url")))
    console.print(t)
