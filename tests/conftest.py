"""Fixtures shared by the service and API tests: one throw-away PostgreSQL server per
session (started here, stopped by PID), a fresh database per user of it."""

from __future__ import annotations

import itertools
import os

import pytest

_db_counter = itertools.count()

# What a GPU would refuse fails the CPU tests too (pstar_core/devices.py); spawned ranks,
# Ray workers and drivers inherit it
os.environ["PSTAR_DEVICE_CHECKS"] = "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    """The second device (tests/fakedevice) is registered before any test runs: autograd
    sizes its per-device queues at the first backward of the process, so a backend added
    after that cannot run backward (an internal assert in torch's engine). Registering it
    changes what torch reports as the accelerator for the rest of the session, as a GPU
    would; the other tests pass either way."""
    if any(
        item.nodeid.startswith("tests/fakedevice/") or item.get_closest_marker("fakegpu")
        for item in session.items
    ):
        from tests import fakedevice

        fakedevice.load()


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    from service.pg_local import PgServer, find_pg_bindir

    if find_pg_bindir() is None:
        # set-up installs them; a missing server must not turn half the store tests green
        # by skipping them, unless asked for explicitly
        why = "PostgreSQL server binaries (initdb) not found: install Debian's postgresql"
        if os.environ.get("PSTAR_TESTS_WITHOUT_POSTGRES") == "1":
            pytest.skip(why + " (PSTAR_TESTS_WITHOUT_POSTGRES=1)")
        pytest.fail(why + ", or set PSTAR_TESTS_WITHOUT_POSTGRES=1 to skip those tests")
    server = PgServer.start(tmp_path_factory.mktemp("pg"))
    yield server
    server.stop()


def fresh_database(server) -> str:
    """A new, empty database on the session's server; its SQLAlchemy URL."""
    import psycopg

    name = f"t{next(_db_counter)}"
    dsn = (
        server.url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    return server.url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """A store URL on each backend (PostgreSQL from the session's server)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return fresh_database(request.getfixturevalue("pg_server"))
