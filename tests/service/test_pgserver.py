"""service/tools/pg_local.py: a throw-away PostgreSQL starts, serves SQLAlchemy, stops
without a trace."""

from __future__ import annotations

import os

import pytest
import sqlalchemy
from sqlalchemy import text

from service.tools.pg_local import PgServer, find_pg_bindir, pid_alive


def test_pgserver_serves_sqlalchemy_and_stops_by_pid(tmp_path_factory):
    if find_pg_bindir() is None:  # as the pg_server fixture: fail unless asked to skip
        why = "PostgreSQL server binaries (initdb) not found: install Debian's postgresql"
        if os.environ.get("PSTAR_TESTS_WITHOUT_POSTGRES") == "1":
            pytest.skip(why + " (PSTAR_TESTS_WITHOUT_POSTGRES=1)")
        pytest.fail(why + ", or set PSTAR_TESTS_WITHOUT_POSTGRES=1 to skip those tests")

    server = PgServer.start(tmp_path_factory.mktemp("pg"))
    try:
        assert server.url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        assert server.url.endswith(f":{server.port}/pstar")
        assert pid_alive(server.pid)
        engine = sqlalchemy.create_engine(server.url)
        try:
            with engine.begin() as conn:
                assert conn.execute(text("SELECT 1")).scalar_one() == 1
                conn.execute(text("CREATE TABLE jobs (id serial PRIMARY KEY, name text)"))
                conn.execute(
                    text("INSERT INTO jobs (name) VALUES (:a), (:b)"),
                    {"a": "ft-1", "b": "ft-2"},
                )
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT id, name FROM jobs ORDER BY id")).all()
                assert [tuple(r) for r in rows] == [(1, "ft-1"), (2, "ft-2")]
                assert conn.execute(text("SELECT current_database()")).scalar() == "pstar"
        finally:
            engine.dispose()
    finally:
        server.stop()

    assert not pid_alive(server.pid)
    assert not server.root.exists()
    server.stop()  # a second stop is harmless
