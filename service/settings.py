"""`Settings`: how the control plane is configured, read once from the environment.

- `PSTAR_DATA_DIR` (default `./pstar-data`): files, models (`models/<id>/`), runs, and
  the SQLite store;
- `PSTAR_DB_URL` (default SQLite `store.db` in the data dir): any SQLAlchemy URL, e.g.
  `postgresql+psycopg://user:password@host/db`; or `PSTAR_DB_URL_FILE`, a file holding it
  (a mounted secret; it wins over `PSTAR_DB_URL`). Ray jobs never carry the URL: the control
  plane gives them the path of a 0600 copy in the data dir (`job_env`);
- `PSTAR_API_TOKENS`: comma-separated `tenant:token` pairs; a bare token is tenant
  `default`;
- `PSTAR_MAX_UPLOAD_BYTES` (default 1 GiB): larger uploads get 413;
- `PSTAR_SPILL_DIR` (default `<data dir>/spill`): the engine's disk tier, per job;
- `PSTAR_RUN_RETENTION_DAYS` (default 30; 0: forever): how long an ended job's run
  directory (checkpoints, prepared data) is kept;
- `RAY_ADDRESS`: a Ray cluster's dashboard URL (`http://head:8265`); without it
  `pstar serve` starts a local head;
- the limits of `Limits` below (`PSTAR_MAX_...`), per tenant and per job, with defaults
  that keep one tenant from taking a shared install.

Paths a client sends are never used as paths: every file the service writes is under the
data dir, with names the service chose.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_MAX_UPLOAD = 1 << 30


GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What one tenant, or one job, may take. Each is set by `PSTAR_<NAME upper-cased>`.

    Over a per-job limit a create is refused (400); over the tenant's unfinished jobs or
    stored bytes, 429; over the running ones, a job waits in `queued` until others end."""

    max_unfinished_jobs_per_tenant: int = 100
    max_running_jobs_per_tenant: int = 4
    max_running_workers_per_tenant: int = 16
    max_running_gpus_per_tenant: int = 8
    max_workers_per_job: int = 8
    max_cpus_per_worker: float = 16.0
    max_file_bytes_per_tenant: int = 20 * GiB
    # files plus what the tenant's ended jobs keep (checkpoints, prepared data, models):
    # a job created past it is a 429 (service.control.storage)
    max_storage_bytes_per_tenant: int = 100 * GiB
    max_spill_bytes_per_job: int = 50 * GiB
    max_attempts: int = 5
    max_event_streams_per_tenant: int = 8
    # chat and text completions: generations in flight per tenant (429 past it), and the
    # tokens one request may ask for (max_tokens past it, or n times it, is a 400)
    max_concurrent_generations_per_tenant: int = 4
    max_tokens_per_request: int = 2048
    # a request body (JSON) past this is a 413 before it is read; uploads have their own
    # limit (PSTAR_MAX_UPLOAD_BYTES) and go to disk as they arrive
    max_request_bytes: int = 8 << 20
    # training sessions (Tinker's API): models a tenant holds at once (a 429 past it), and
    # how long a session lives without a heartbeat or request before its models are freed;
    # one whose client sent heartbeats (the SDK, every 10 s) and stopped is ended sooner:
    # its process is gone (the SDK warns at 120 s that the session will be ended)
    max_session_models_per_tenant: int = 2
    session_idle_s: float = 600.0
    session_lost_s: float = 120.0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Limits:
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = "PSTAR_" + f.name.upper()
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                v = float(raw) if "float" in str(f.type) else int(raw)
            except ValueError:
                raise SettingsError(f"{var} must be a number, got {raw!r}") from None
            if v <= 0:
                raise SettingsError(f"{var} must be positive, got {raw!r}")
            values[f.name] = v
        return cls(**values)

    @staticmethod
    def var(name: str) -> str:
        """The environment variable that sets limit `name`."""
        return "PSTAR_" + name.upper()


@dataclass(frozen=True)
class ServeSettings:
    """How models are served on Ray Serve (`service.serving.deployments`). Each is set by
    `PSTAR_SERVE_<NAME upper-cased>`.

    A replica reserves `replica_cpus` CPUs and `replica_gpus` GPUs of the cluster: on CPU
    the default 0 lets a replica share cores with training instead of holding CPUs a
    training job waits for; `replica_gpus` "auto" (None) is 1 on a cluster that has GPUs
    and 0 on one that has none (a fraction packs several models on one GPU)."""

    port: int = 8001  # Serve's HTTP proxy on the head (8000 is the API's own default)
    host: str = "127.0.0.1"  # where the proxy listens (0.0.0.0 in a cluster)
    url: str = ""  # how the control plane reaches the proxy; default http://127.0.0.1:port
    idle_s: float = 300.0  # a model's last replica stops after this long without requests
    max_adapters: int = 8  # LoRA adapters one replica keeps loaded (LRU)
    max_replicas: int = 1
    max_batch: int = 32  # rows one replica decodes together
    # prompts' keys and values a replica keeps across requests (prefix caching), on its
    # device; 0 keeps none
    prefix_cache_mb: int = 512
    replica_cpus: float = 0.0
    replica_gpus: float | None = None  # None: auto
    start_timeout_s: float = 180.0  # a model not answering by then is a 503
    # a tenant's own models (full fine-tunes: an application each) in memory at once; past
    # it, loading another is a 429 (adapters share their base's application, LRU-bounded)
    max_models_per_tenant: int = 2

    @classmethod
    def from_env(cls, env: dict[str, str]) -> ServeSettings:
        values: dict = {}
        for f in fields(cls):
            var = "PSTAR_SERVE_" + f.name.upper()
            raw = env.get(var, "").strip()
            if not raw:
                continue
            if f.name in ("host", "url"):
                values[f.name] = raw.rstrip("/")
                continue
            if f.name == "replica_gpus" and raw == "auto":
                continue
            try:
                v = float(raw) if "float" in str(f.type) else int(raw)
            except ValueError:
                raise SettingsError(f"{var} must be a number, got {raw!r}") from None
            if v < 0 or (v == 0 and f.name not in ("replica_cpus", "replica_gpus")):
                raise SettingsError(f"{var} must be positive, got {raw!r}")
            values[f.name] = v
        return cls(**values)

    @property
    def proxy_url(self) -> str:
        return self.url or f"http://127.0.0.1:{self.port}"


class SettingsError(ValueError):
    """The environment configures the service wrongly; the message says which variable."""


def redacted(url: str) -> str:
    """A store URL fit for a log line: its user and password replaced by ***."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    db_url: str = field(repr=False)  # it may hold the database's password
    tokens: dict[str, str] = field(repr=False)  # token -> tenant
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD
    ray_address: str | None = None
    # the API's documentation (/docs, /redoc, /openapi.json) is served without a token: it
    # is the same for every tenant and holds no data; PSTAR_API_DOCS=off removes it
    api_docs: bool = True
    # PSTAR_DEFAULT_RESOURCES: what a job that does not say gets (a deployment with GPU
    # workers sets {"use_gpu": true, ...}); the fields a request gives win
    default_resources: dict = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    # PSTAR_METRICS_TOKEN: Prometheus' token; /metrics with it counts every tenant's jobs
    # (a tenant's token counts its own)
    metrics_token: str | None = field(default=None, repr=False)
    serve: ServeSettings = field(default_factory=ServeSettings)
    # PSTAR_SPILL_DIR: where the engine's disk tier writes, `<it>/<job id>` on each worker's
    # node (a node-local volume in a cluster, docs/deploy.md); None: `<data dir>/spill`
    spill_root: Path | None = None
    # PSTAR_RUN_RETENTION_DAYS: an ended job's run directory (checkpoints, prepared data)
    # is reclaimed this long after it ended; its exported model stays. 0: kept forever
    run_retention_days: float = 30.0
    # PSTAR_SESSION_ENGINES: where training sessions' engines run: "ray" (the service's
    # default: Ray actors per training model, which the control plane reaches through
    # Ray's client at PSTAR_SESSION_RAY_ADDRESS: the embedded head's, or ray://<the job
    # server's host>:10001) or "local" (the control plane's own process: what a Settings
    # made in code, as the tests' are, gets unless it says otherwise)
    session_engines: str = "local"
    session_ray_address: str | None = None
    # PSTAR_PYTHON_GRADERS=on: reinforcement graders of type python run (the tenant's code,
    # in a sandboxed process: service/methods/python_grader.py); off by default: a 400
    python_graders: bool = False
    # PSTAR_API_URL: where a job's workers reach this API (a reinforcement job's score_model
    # graders ask their models through its chat completions); `pstar serve` sets it to
    # where it listens, a cluster to the control plane's service
    api_url: str = "http://127.0.0.1:8000"
    # PSTAR_EMBEDDING_MODEL: a directory holding the model `/v1/embeddings` runs (and the
    # `cosine` text-similarity grader with it): service/serving/embeddings.py; None: no
    # embeddings (those requests are 404s, cosine graders 400s)
    embedding_model: Path | None = None

    @property
    def embedding_model_name(self) -> str | None:
        """The name requests give the embedding model: its directory's name."""
        return self.embedding_model.name if self.embedding_model is not None else None

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"

    def job_dir(self, job_id: str) -> Path:
        return self.runs_dir / job_id

    def spill_dir(self, job_id: str) -> Path:
        """Where a job's ranks spill chunks (the engine's `memory.disk_dir`)."""
        return (self.spill_root or self.data_dir / "spill") / job_id

    def sessions_dir(self, tenant: str) -> Path:
        """Where a tenant's training sessions keep their checkpoints (service.sessions)."""
        return self.data_dir / "sessions" / tenant

    def finetuned_dir(self, job_id: str) -> Path:
        """Where a job's exported model goes (hidden from the base-model scan by the dot)."""
        return self.models_dir / ".ft" / job_id

    @property
    def serving_dir(self) -> Path:
        """What each model replica reports it holds (`<app>/<replica>.json`)."""
        return self.data_dir / "serving"

    def ensure_dirs(self) -> None:
        for d in (self.files_dir, self.models_dir, self.runs_dir):
            d.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        data_dir = Path(env.get("PSTAR_DATA_DIR") or "pstar-data").resolve()
        db_url = _db_url_from_file(env.get("PSTAR_DB_URL_FILE")) or env.get("PSTAR_DB_URL")
        db_url = db_url or default_db_url(data_dir)
        raw_max = env.get("PSTAR_MAX_UPLOAD_BYTES", "")
        try:
            max_upload = int(raw_max) if raw_max else DEFAULT_MAX_UPLOAD
        except ValueError:
            raise SettingsError(
                f"PSTAR_MAX_UPLOAD_BYTES must be a whole number of bytes, got {raw_max!r}"
            ) from None
        if max_upload <= 0:
            raise SettingsError(f"PSTAR_MAX_UPLOAD_BYTES must be positive, got {max_upload}")
        docs = env.get("PSTAR_API_DOCS", "on").strip().lower()
        if docs not in ("on", "off"):
            raise SettingsError(f"PSTAR_API_DOCS must be 'on' or 'off', got {docs!r}")
        python_graders = env.get("PSTAR_PYTHON_GRADERS", "off").strip().lower()
        if python_graders not in ("on", "off"):
            raise SettingsError(
                f"PSTAR_PYTHON_GRADERS must be 'on' or 'off', got {python_graders!r}"
            )
        return cls(
            embedding_model=_embedding_model(env.get("PSTAR_EMBEDDING_MODEL", "")),
            data_dir=data_dir,
            db_url=db_url,
            tokens=parse_tokens(env.get("PSTAR_API_TOKENS", "")),
            max_upload_bytes=max_upload,
            ray_address=env.get("RAY_ADDRESS") or None,
            api_docs=docs == "on",
            default_resources=parse_default_resources(env.get("PSTAR_DEFAULT_RESOURCES", "")),
            limits=Limits.from_env(env),
            metrics_token=env.get("PSTAR_METRICS_TOKEN") or None,
            serve=ServeSettings.from_env(env),
            spill_root=Path(env["PSTAR_SPILL_DIR"]) if env.get("PSTAR_SPILL_DIR") else None,
            run_retention_days=_retention_days(env.get("PSTAR_RUN_RETENTION_DAYS", "")),
            session_engines=_session_engines(env.get("PSTAR_SESSION_ENGINES", "")),
            session_ray_address=env.get("PSTAR_SESSION_RAY_ADDRESS") or None,
            python_graders=python_graders == "on",
            api_url=_api_url(env.get("PSTAR_API_URL", "")),
        )


def loopback(url: str) -> bool:
    """Whether `url` (a URL, or host:port) names this machine's loopback interface."""
    from ipaddress import ip_address
    from urllib.parse import urlsplit

    host = urlsplit(url if "://" in url else f"http://{url}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def _api_url(raw: str) -> str:
    value = raw.strip().rstrip("/") or Settings.api_url
    if not re.fullmatch(r"https?://[^/\s@]+(/\S*)?", value):
        raise SettingsError(
            f"PSTAR_API_URL must be the API's http(s) address without credentials "
            f"(http://host:port), got {raw!r}"
        )
    return value.removesuffix("/v1")


def _embedding_model(raw: str) -> Path | None:
    if not raw.strip():
        return None
    path = Path(raw.strip()).expanduser().resolve()
    if not path.is_dir():
        raise SettingsError(
            f"PSTAR_EMBEDDING_MODEL must be a directory, and {raw!r} is not one; name the "
            "directory of a sentence-transformers (or transformers) model, or leave it unset"
        )
    return path


def _session_engines(raw: str) -> str:
    value = raw.strip().lower() or "ray"
    if value not in ("local", "ray"):
        raise SettingsError(
            f"PSTAR_SESSION_ENGINES must be 'local' (the control plane's process) or 'ray' "
            f"(a Ray actor per training model), got {raw!r}"
        )
    return value


def _retention_days(raw: str) -> float:
    if not raw.strip():
        return Settings.run_retention_days
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if not (days >= 0 and days != float("inf")):
        raise SettingsError(
            f"PSTAR_RUN_RETENTION_DAYS must be a number of days, 0 to keep runs forever, "
            f"got {raw!r}"
        )
    return days


def default_db_url(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'store.db'}"


def _db_url_from_file(path: str | None) -> str | None:
    if not path:
        return None
    try:
        url = Path(path).read_text().strip()
    except OSError as e:
        raise SettingsError(f"PSTAR_DB_URL_FILE={path}: cannot read it ({e.strerror})") from None
    if not url:
        raise SettingsError(f"PSTAR_DB_URL_FILE={path} is empty; it must hold the store's URL")
    return url


def job_env(settings: Settings) -> dict[str, str]:
    """The environment a Ray job of this control plane gets: where the data is, and where
    to read the store's URL. Ray shows a job's environment on its dashboard, so the URL
    itself (with its password) is never in it: a URL other than the data dir's default
    SQLite is written to `<data dir>/secrets/db_url` (mode 0600), a path on the volume the
    workers already mount, and the job gets that path."""
    env = {"PSTAR_DATA_DIR": str(settings.data_dir), "PSTAR_API_URL": settings.api_url}
    if settings.spill_root is not None:
        env["PSTAR_SPILL_DIR"] = str(settings.spill_root)
    if settings.db_url == default_db_url(settings.data_dir):
        return env
    path = settings.data_dir / "secrets" / "db_url"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        same = path.read_text().strip() == settings.db_url
    except OSError:
        same = False
    if not same:
        tmp = path.with_name(f".db_url.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(settings.db_url + "\n")
        os.replace(tmp, path)
    env["PSTAR_DB_URL_FILE"] = str(path)
    return env


def parse_default_resources(raw: str) -> dict:
    """PSTAR_DEFAULT_RESOURCES: a JSON object of job `resources` fields, checked as a job's."""
    if not raw.strip():
        return {}
    import json

    from pydantic import ValidationError

    from service.spec.resources import Resources

    try:
        value = json.loads(raw)
        Resources(**value)
    except (json.JSONDecodeError, TypeError, ValidationError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SettingsError(
            "PSTAR_DEFAULT_RESOURCES must be a JSON object of job resources, e.g. "
            f'{{"num_workers": 2, "use_gpu": true}}: {msg}'
        ) from None
    return value


def parse_tokens(raw: str) -> dict[str, str]:
    """`tenant:token,token2` -> {token: tenant}; a bare token belongs to tenant `default`.
    A token given as `sha256:<64 hex digits>` is the SHA-256 of the secret, so the
    environment need not hold the secret itself (`pstar keys hash` prints one)."""
    out: dict[str, str] = {}
    for i, item in enumerate(x.strip() for x in raw.split(",")):
        if not item:
            continue
        tenant, sep, token = item.rpartition(":")
        if tenant == "sha256" or tenant.endswith(":sha256"):
            tenant, token = tenant.removesuffix("sha256").removesuffix(":"), "sha256:" + token
            sep = ":" if tenant else ""
            if not re.fullmatch(r"[0-9a-f]{64}", token[7:]):
                raise SettingsError(
                    f"PSTAR_API_TOKENS entry {i + 1}: a sha256: token must be 64 lower-case "
                    "hex digits (the secret's SHA-256)"
                )
        tenant = tenant if sep else "default"
        if not TENANT_RE.match(tenant):
            raise SettingsError(
                f"PSTAR_API_TOKENS entry {i + 1}: tenant {tenant!r} must be 1-64 letters, digits, "
                "'.', '_' or '-'"
            )
        if len(token) < 8:
            raise SettingsError(
                f"PSTAR_API_TOKENS entry {i + 1} (tenant {tenant}): a token needs at least 8 "
                "characters"
            )
        if token in out and out[token] != tenant:
            raise SettingsError(f"PSTAR_API_TOKENS: one token is given to two tenants ({tenant})")
        out[token] = tenant
    return out


def new_token() -> str:
    return "pstar-" + secrets.token_urlsafe(24)
