"""Start a throw-away PostgreSQL server (for benchmarks and tests), and stop it by its PID.

The store's tests and `pstar bench api` run against a real PostgreSQL, not a mock. The
server refuses to run as root, and sessions and CI run as root, so when we are root every
server command goes through `runuser -u pstar-pg --`, an unprivileged system user created
once on first use. That user must be able to reach the data directory: when
the given base directory is not traversable by others (pytest's base temp dir is mode
0700) the server lives in a fresh 0755 directory under /tmp instead. The server runs with
`fsync=off`: it is thrown away, durability buys nothing.

Use: `server = PgServer.start(base_dir)`; connect to `server.url` (SQLAlchemy, psycopg 3
driver, database `pstar`, user `postgres`, trust auth on 127.0.0.1); `server.stop()` at the
end, which stops the postmaster by PID (fast shutdown, then SIGKILL) and deletes the
server's directory. `find_pg_bindir()` is None when the server binaries are missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_USER = "pstar-pg"
DB_NAME = "pstar"
START_ATTEMPTS = 3  # a free port can be taken by someone else before the server binds it


def find_pg_bindir() -> Path | None:
    """The directory with `initdb`, `pg_ctl` and `postgres`: `pg_config --bindir` first, then
    Debian's /usr/lib/postgresql/VERSION/bin, newest version first; None if there is none."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in path.parent.name.split(".") if p.isdigit())

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    return next((d for d in candidates if os.access(d / "initdb", os.X_OK)), None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _system_tool(name: str) -> str:
    """Path of a system tool that may live in an sbin directory missing from PATH."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


def ensure_pg_user() -> None:
    """Create the unprivileged system user the server runs as when we are root (once)."""
    try:
        pwd.getpwnam(PG_USER)
        return
    except KeyError:
        pass
    argv = [_system_tool("useradd"), "-r", "-M", "-s", "/usr/sbin/nologin", PG_USER]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 9):  # 9: created meanwhile by another process
        raise RuntimeError(f"useradd {PG_USER} failed: {done.stderr.strip()}")


def _traversable_by_others(path: Path) -> bool:
    """Whether a user that owns nothing on the way can reach `path` (o+x on it and above)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, waiting for a reaper that is not us, counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return fields[0] != "Z"


@dataclass
class PgServer:
    """A running throw-away server; everything it owns lives under `root`."""

    url: str
    pid: int
    port: int
    root: Path
    bindir: Path
    as_root: bool
    stopped: bool = field(default=False, init=False)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @classmethod
    def start(cls, base_dir: Path, *, timeout: float = 60.0) -> PgServer:
        """initdb, start on a free port and create database `pstar`; raise RuntimeError with
        the server log if it does not come up. The server's files go in a new directory."""
        bindir = find_pg_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL server binaries (initdb) not found: install postgresql")
        as_root = os.geteuid() == 0
        base_dir = Path(base_dir).resolve()
        base_dir.mkdir(parents=True, exist_ok=True)
        if as_root:
            ensure_pg_user()
            if not _traversable_by_others(base_dir):
                base_dir = Path(tempfile.gettempdir())
        root = Path(tempfile.mkdtemp(prefix="pstar-pg-", dir=base_dir))
        server = cls("", 0, 0, root, bindir, as_root)
        try:
            server._init_and_start(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _cmd(self, tool: str, *args: str) -> list[str]:
        argv = [str(self.bindir / tool), *args]
        return [_system_tool("runuser"), "-u", PG_USER, "--", *argv] if self.as_root else argv

    def _run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.root, capture_output=True, text=True, timeout=timeout, check=False
        )

    def _init_and_start(self, timeout: float) -> None:
        self.root.chmod(0o755)
        (self.root / "sock").mkdir()
        if self.as_root:
            pg = pwd.getpwnam(PG_USER)
            for path in (self.root, self.root / "sock"):
                os.chown(path, pg.pw_uid, pg.pw_gid)
        init = self._cmd("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres")
        done = self._run([*init, "-E", "UTF8", "--locale=C", "--no-sync"], timeout)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout}{done.stderr}")
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            done = self._pg_ctl_start(timeout)
            if done.returncode == 0:
                break
            if "could not bind" not in self._server_log():
                raise RuntimeError(
                    f"pg_ctl start failed:\n{done.stdout}{done.stderr}{self._server_log()}"
                )
        else:
            raise RuntimeError(f"no free port after {START_ATTEMPTS} attempts")
        self.pid = self._postmaster_pid()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{DB_NAME}"
        self._create_database()

    def _pg_ctl_start(self, timeout: float) -> subprocess.CompletedProcess[str]:
        options = f"-p {self.port} -k {self.root / 'sock'} -c listen_addresses=127.0.0.1"
        options += " -c fsync=off"  # a throw-away server: durability buys nothing
        log = str(self.root / "postgres.log")
        ctl = self._cmd("pg_ctl", "-D", str(self.data_dir), "-o", options, "-l", log)
        return self._run([*ctl, "start", "-w", "-t", str(int(timeout))], timeout + 10)

    def _server_log(self) -> str:
        log = self.root / "postgres.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def halt(self, timeout: float = 30.0) -> None:
        """Stop the server as a crash would (`pg_ctl stop -m immediate`: every connection
        dropped, no shutdown checkpoint), keeping its data: an outage that `resume` ends."""
        stop = self._cmd("pg_ctl", "-D", str(self.data_dir), "stop", "-m", "immediate", "-w")
        done = self._run([*stop, "-t", str(int(timeout))], timeout + 10)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed:\n{done.stdout}{done.stderr}")

    def resume(self, timeout: float = 60.0) -> None:
        """Start a halted server again on the same port (crash recovery runs first)."""
        done = self._pg_ctl_start(timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"pg_ctl start failed:\n{done.stdout}{done.stderr}{self._server_log()[-3000:]}"
            )
        self.pid = self._postmaster_pid()

    def _postmaster_pid(self) -> int:
        """The PID in the data directory's postmaster.pid, or 0 if there is none."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return 0

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f"CREATE DATABASE {DB_NAME}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the postmaster by PID (`pg_ctl stop -m fast`, then SIGKILL) and delete `root`.
        Safe to call twice and on a half-started server."""
        if self.stopped:
            return
        self.stopped = True
        self.pid = self.pid or self._postmaster_pid()
        if self.pid and pid_alive(self.pid):
            stop = self._cmd("pg_ctl", "-D", str(self.data_dir), "stop", "-m", "fast", "-w")
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._run([*stop, "-t", str(int(timeout))], timeout + 10)
            if pid_alive(self.pid):
                self._kill(timeout)
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill(self, timeout: float) -> None:
        """SIGKILL the postmaster and remove the small SysV shared-memory segment it would
        have removed itself (its id is on line 7 of postmaster.pid: "KEY ID")."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            lines = []
        shmem = lines[6].split() if len(lines) > 6 else []
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(shmem) == 2 and shmem[1].isdigit():
            ipcrm = [_system_tool("ipcrm"), "-m", shmem[1]]
            subprocess.run(ipcrm, capture_output=True, check=False)
