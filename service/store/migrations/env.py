"""Alembic environment: migrations run on the connection the `Store` hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from service.store.models import Base

target_metadata = Base.metadata


def run() -> None:
    conn = context.config.attributes.get("connection")
    if conn is None:  # `alembic` on the command line: -x url=...
        url = context.get_x_argument(as_dictionary=True)["url"]
        with create_engine(url).begin() as c:
            _migrate(c)
    else:
        _migrate(conn)


def _migrate(conn) -> None:
    context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
