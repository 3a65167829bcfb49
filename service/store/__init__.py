"""The store: the record of files, jobs, attempts, events, metrics and checkpoints.

`Store(url)` opens the database (`db.Database`: SQLite or PostgreSQL) and `migrate()`
brings the schema to Alembic's head. Its resources share that one engine, as the API's
routers share the app:

    store.files        uploaded files and results files       (files.py)
    store.jobs         jobs, their status and their end       (jobs.py)
    store.attempts     a job's attempts, one Ray job each     (attempts.py)
    store.events       events, metric points, engine stats    (events.py)
    store.checkpoints  the checkpoints attempts record        (checkpoints.py)
    store.keys         API keys, as hashes of their secrets    (keys.py)

Each call opens a short transaction and returns detached rows; every read a client can
cause filters on the tenant. Terminal job states never change (every status write is a
conditional UPDATE that matches only non-terminal rows), and writes that come from an
attempt are fenced to that attempt being the job's current, unended one (`StaleAttempt`).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine

from service.store.attempts import Attempts
from service.store.checkpoints import Checkpoints
from service.store.db import Database, StaleAttempt, is_outage
from service.store.events import Events
from service.store.files import Files
from service.store.jobs import (
    ActiveAttempt,
    ActiveJob,
    IdempotencyConflict,
    Jobs,
    TooManyUnfinished,
    request_hash,
)
from service.store.keys import Keys
from service.store.models import (
    ACTIVE,
    TERMINAL,
    ApiKey,
    Attempt,
    Base,
    Checkpoint,
    Event,
    File,
    Job,
    JobStats,
    MetricPoint,
    new_id,
)

__all__ = [
    "ACTIVE",
    "TERMINAL",
    "ActiveAttempt",
    "ActiveJob",
    "ApiKey",
    "Attempt",
    "Base",
    "Checkpoint",
    "Event",
    "File",
    "IdempotencyConflict",
    "Job",
    "JobStats",
    "MetricPoint",
    "StaleAttempt",
    "Store",
    "TooManyUnfinished",
    "is_outage",
    "new_id",
    "request_hash",
]

MIGRATIONS = Path(__file__).with_name("migrations")


class Store:
    """The store's entry point: the engine (`db`) and one object per resource on it."""

    def __init__(self, url: str, *, pool_size: int = 20) -> None:
        self.url = url
        self.db = Database(url, pool_size=pool_size)
        self.engine: Engine = self.db.engine
        self.files = Files(self.db)
        self.jobs = Jobs(self.db)
        self.attempts = Attempts(self.db)
        self.events = Events(self.db)
        self.checkpoints = Checkpoints(self.db)
        self.keys = Keys(self.db)

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent)."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self.db.writing() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def ping(self) -> None:
        with self.db.read() as s:
            s.execute(select(1))

    def close(self) -> None:
        self.engine.dispose()
