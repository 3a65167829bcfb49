"""The hot paths' statements: built once, with bound parameters, run on a connection
(SQLAlchemy Core), reading rows as plain objects rather than ORM instances.

An API request reads a job or a page of jobs, or creates one, several hundred times a
second on a small box, and the reconciler moves every new job on. Through the ORM each
such read cost ~0.4 ms of CPU (a statement built, its cache key computed, a session
opened, the rows turned into tracked objects) against ~0.1 ms for the same query
prebuilt and run on a connection (measured on this machine, SQLite, 300 jobs). The rows
come back as `View`s: the same attribute names as the ORM object (`job.metadata_`,
`job.plan`), so what renders one renders the other; a job's view leaves out `request`
(the body as given, which only the idempotency check reads).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import orjson
from sqlalchemy import bindparam, func, inspect, select, text
from sqlalchemy.engine import Connection, Result

from service.store import status
from service.store.models import TERMINAL, UNFINISHED, Event, File, Job

_JOBS = Job.__table__
_FILES = File.__table__
_EVENTS = Event.__table__


class View(SimpleNamespace):
    """A row's values under the ORM's attribute names, to read (rendering a job reads ~30
    of them: ~0.4 µs each from a SQLAlchemy `Row`, ~0.03 µs from a plain object)."""


def _views(result: Result) -> Iterator[View]:
    keys = tuple(result.keys())
    return (View(**dict(zip(keys, row, strict=True))) for row in result)


def _view(result: Result) -> View | None:
    return next(_views(result), None)


def _attributes(model: Any) -> dict[str, Any]:
    """A model's columns by the ORM's attribute names (`metadata_` is column `metadata`)."""
    return {prop.key: prop.columns[0] for prop in inspect(model).column_attrs}


_COLUMNS = {model: _attributes(model) for model in (Job, File, Event)}

# every column of a job but the request, each under the ORM's attribute name
JOB_VIEW = [col.label(attr) for attr, col in _COLUMNS[Job].items() if attr != "request"]
_FILE_ROW = [col.label(attr) for attr, col in _COLUMNS[File].items()]

_JOB_BY_ID = select(*JOB_VIEW).where(
    _JOBS.c.id == bindparam("id"), _JOBS.c.tenant == bindparam("tenant")
)
_FILE_BY_ID = select(*_FILE_ROW).where(
    _FILES.c.id == bindparam("id"), _FILES.c.tenant == bindparam("tenant")
)
# a tenant's unfinished jobs, counted up to a cap: the quota check at every create costs
# what the quota allows, not what the tenant has queued
_UNFINISHED = select(func.count()).select_from(
    select(_JOBS.c.seq)
    .where(_JOBS.c.tenant == bindparam("tenant"), _JOBS.c.status.in_(UNFINISHED))
    .limit(bindparam("cap"))
    .subquery()
)


def _page(status: bool, before: bool) -> Any:
    q = select(*JOB_VIEW).where(_JOBS.c.tenant == bindparam("tenant"))
    if status:
        q = q.where(_JOBS.c.status == bindparam("status"))
    if before:
        q = q.where(_JOBS.c.seq < bindparam("before"))
    return q.order_by(_JOBS.c.seq.desc()).limit(bindparam("limit"))


# a page of a tenant's jobs, newest first, by which filters it has; and all of them
_PAGES = {(s, b): _page(s, b) for s in (False, True) for b in (False, True)}
_ALL = {k: q.limit(None) for k, q in _PAGES.items()}

# PostgreSQL: a transaction-scoped lock on the tenant's name (SQLite writes one at a time)
TENANT_LOCK = text("SELECT pg_advisory_xact_lock(hashtext(:tenant))")


def job(conn: Connection, tenant: str, job_id: str) -> View | None:
    return _view(conn.execute(_JOB_BY_ID, {"id": job_id, "tenant": tenant}))


def jobs_page(
    conn: Connection, tenant: str, status: str | None, before: int | None, limit: int | None
) -> Any:
    """The tenant's jobs newest first, with `status`, older than the job at `before`;
    `limit` of them, or (None) all, as they come (for a filter the query cannot express
    portably, such as metadata)."""
    params: dict[str, Any] = {"tenant": tenant}
    if status:
        params["status"] = status
    if before is not None:
        params["before"] = before
    key = bool(status), before is not None
    if limit is None:
        return _views(conn.execute(_ALL[key], params))
    return list(_views(conn.execute(_PAGES[key], {**params, "limit": limit})))


def file(conn: Connection, tenant: str, file_id: str) -> View | None:
    return _view(conn.execute(_FILE_BY_ID, {"id": file_id, "tenant": tenant}))


def unfinished_jobs(conn: Connection, tenant: str, cap: int) -> int:
    """How many of the tenant's jobs are unfinished, or `cap` if at least that many."""
    return int(conn.execute(_UNFINISHED, {"tenant": tenant, "cap": cap}).scalar_one())


def insert_job(conn: Connection, job: Job, event: Event) -> None:
    """A new job and its first event, as two INSERTs on `conn` (in its transaction);
    `job.seq` is set to the job's place."""
    job.seq = conn.execute(_JOBS.insert(), _values(job)).inserted_primary_key[0]
    insert_event(conn, event)


def insert_event(conn: Connection, event: Event) -> None:
    conn.execute(_EVENTS.insert(), _values(event))


def update_job(
    conn: Connection, job_id: str, values: dict[str, Any], only_from: str | None = None
) -> bool:
    """Set `values` (by attribute name) on a job that is not terminal yet; whether it was.
    A new `status` is held to `service.store.status.JOB_TRANSITIONS`: the row changes only
    if the job's status now is one the table lets it come from (or is that status)."""
    q = _JOBS.update().where(_JOBS.c.id == job_id, _JOBS.c.status.not_in(TERMINAL))
    if only_from is not None:
        q = q.where(_JOBS.c.status == only_from)
    if (new := values.get("status")) is not None:
        q = q.where(_JOBS.c.status.in_([*status.sources(new), status.JobStatus(new)]))
    q = q.values({_COLUMNS[Job][k]: v for k, v in values.items()})
    return conn.execute(q).rowcount == 1


def _values(obj: Any) -> dict[str, Any]:
    """An ORM object's column values by column name, leaving out those it never set
    that the table fills in (the sequence, defaults)."""
    out = {}
    for attr, col in _COLUMNS[type(obj)].items():
        value = obj.__dict__.get(attr)
        if value is None and (col.primary_key or col.default is not None):
            continue
        out[col.key] = value
    return out


def dumps(value: Any) -> str:
    """The store's JSON encoder: strict JSON, which PostgreSQL's `json` takes (it refuses
    NaN and Infinity, which `json.dumps` writes): a non-finite number is stored as null, on
    either backend. Integers past 64 bits, which orjson refuses, go through `json`."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:
        return json.dumps(_finite(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def loads(text: str | bytes) -> Any:
    """The store's JSON decoder: orjson, and the standard module for what orjson refuses
    and `json.dumps` writes (NaN and Infinity in rows written before `dumps`, integers
    past 64 bits)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
