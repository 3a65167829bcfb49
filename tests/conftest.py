"""Fixtures shared by the service and API tests: one throw-away PostgreSQL server per
session (started here, stopped by PID), a fresh database per user of it; and the one rule
for tests that build C++ (`requires_compiler`)."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

_db_counter = itertools.count()

# What a GPU would refuse fails the CPU tests too (pstar_core/devices.py); spawned ranks,
# Ray workers and drivers inherit it
os.environ["PSTAR_DEVICE_CHECKS"] = "1"


# [Note: tests that build C++] The engine's host AdamW kernel (pstar_core/kernels/adam.cpp)
# and the test suite's second device (tests/fakedevice/fakegpu.cpp) are C++ extensions
# built on first use. A test that needs one built carries `requires_compiler` (every test
# on the fakegpu device has it added below). Where nothing can build C++ such a test fails
# and says why, as a missing PostgreSQL does: the C++ kernel is the production path, and a
# suite that turned green on the fallback alone would hide it. PSTAR_TESTS_WITHOUT_COMPILER=1
# skips them instead, with the same reason. The engine's fallback to torch's fused AdamW,
# when its build fails, is tested everywhere (tests/core/test_adam_kernel.py: a missing
# compiler, CXX=/nonexistent, and a source that does not compile).
WITHOUT_COMPILER = "PSTAR_TESTS_WITHOUT_COMPILER"


@functools.cache
def compiler_missing() -> str | None:
    """Why C++ extensions cannot be built here, or None if they can: what
    torch.utils.cpp_extension needs (the compiler it calls, ninja, the Python headers)."""
    from torch.utils import cpp_extension

    cxx = cpp_extension.get_cxx_compiler()  # $CXX, else c++
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} ($CXX, else c++) is not found"
    if not cpp_extension.is_ninja_available():
        return "ninja (torch's extension builder) is not found"
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "the Python headers (Python.h) are not installed"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires_compiler: builds a C++ extension; fails where none can be built, unless "
        f"{WITHOUT_COMPILER}=1 (then skips) [Note: tests that build C++]",
    )


def _on_fakegpu(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/fakedevice/") or bool(item.get_closest_marker("fakegpu"))


# [Note: parallel tests] scripts/test.sh runs the suite on a process per two cores
# (pytest-xdist; on 2 cores one process, see scripts/test.sh; `-n N` by hand).
# A module's tests stay on one process (they share module fixtures: a server, a browser, a
# trained model), and the modules that start a Ray cluster or a whole `pstar serve` are
# one unit, so one such cluster runs at a time: two on 2 cores would make each slower
# than the waits their tests allow. The other modules fill the other processes meanwhile
# (most of the Ray tests' wall time is waiting on their cluster). The units are made by a
# scheduler of our own (`pytest_xdist_make_scheduler`): xdist's `loadgroup` reads groups
# from node ids that pytest 9.2 no longer lets it change.
RAY_MODULES = frozenset(
    {
        "tests/api/test_dashboard.py",
        "tests/benchmarks/test_faults.py",
        "tests/service/test_methods_ray.py",
        "tests/service/test_ray_train.py",
        "tests/service/test_service_ray.py",
        "tests/service/test_serving_ray.py",
    }
)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Work units of whole modules, the Ray modules one unit (see [Note: parallel tests])."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ray" if module in RAY_MODULES else module

    return ByModule(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _on_fakegpu(item):  # the device is a C++ extension
            item.add_marker(pytest.mark.requires_compiler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture builds something (see [Note: tests that build C++])."""
    if item.get_closest_marker("requires_compiler") is None:
        return
    why = compiler_missing()
    if why is None:
        return
    if os.environ.get(WITHOUT_COMPILER) == "1":
        pytest.skip(f"{why} ({WITHOUT_COMPILER}=1)")
    pytest.fail(
        f"{why}: this test builds a C++ extension; install a C++ compiler (Debian: g++), "
        f"ninja and the Python headers, or set {WITHOUT_COMPILER}=1 to skip such tests",
        pytrace=False,
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """The second device (tests/fakedevice) is registered before any test runs: autograd
    sizes its per-device queues at the first backward of the process, so a backend added
    after that cannot run backward (an internal assert in torch's engine). Registering it
    changes what torch reports as the accelerator for the rest of the session, as a GPU
    would; the other tests pass either way. Where it cannot be built its tests fail (or
    skip) each with the reason (`requires_compiler`), not the whole session here."""
    if compiler_missing() is None and any(_on_fakegpu(item) for item in session.items):
        from tests import fakedevice

        fakedevice.load()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for a module's page tests (`tests.browser`)."""
    from tests.browser import chromium_session

    with chromium_session() as driver:
        yield driver


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    from service.tools.pg_local import PgServer, find_pg_bindir

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
