"""service/control/preflight: deployments that would lose jobs are refused before `pstar serve`
serves, saying what to set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from service.control.preflight import check_cluster, check_store, is_local_address
from service.settings import Settings, SettingsError


def settings(tmp_path, **env) -> Settings:
    return Settings.from_env({"PSTAR_DATA_DIR": str(tmp_path), **env})


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("http://127.0.0.1:8265", True),
        ("http://localhost:8265", True),
        ("127.0.0.2:6379", True),
        ("http://10.1.2.3:8265", False),
        ("http://ray-head.pstar.svc:8265", False),
        ("ray://203.0.113.5:10001", False),
    ],
)
def test_ray_addresses_on_this_machine_are_told_from_clusters_elsewhere(address, local):
    assert is_local_address(address) is local


def test_sqlite_with_a_cluster_elsewhere_is_refused_and_postgresql_is_not(tmp_path):
    with pytest.raises(SettingsError, match=r"SQLite .* cluster elsewhere.*PostgreSQL"):
        check_store(settings(tmp_path, RAY_ADDRESS="http://10.1.2.3:8265"))
    check_store(settings(tmp_path, RAY_ADDRESS="http://127.0.0.1:8265"))
    check_store(
        settings(tmp_path, RAY_ADDRESS="http://10.1.2.3:8265", PSTAR_DB_URL="postgresql://db/x")
    )


def test_pstar_serve_exits_2_naming_what_to_set(tmp_path):
    env = {**os.environ, "PSTAR_DATA_DIR": str(tmp_path), "RAY_ADDRESS": "http://10.9.8.7:8265"}
    env.pop("PSTAR_DB_URL", None)
    r = subprocess.run(
        [sys.executable, "-m", "pstar", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "PSTAR_DB_URL" in r.stdout
    assert not (tmp_path / "store.db").exists()  # nothing was created


class _Dashboard(BaseHTTPRequestHandler):
    version = "0.0.1"

    def do_GET(self):
        body = json.dumps({"version": "4", "ray_version": self.version}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_a):
        return


class _Launcher:
    python = sys.executable

    def __init__(self, url: str, ends: str) -> None:
        self.dashboard_url, self.ends = url, ends
        self.submitted: list[str] = []

    def client(self):
        return self

    def submit_job(self, entrypoint: str, submission_id: str, **_kw) -> None:
        self.submitted.append(entrypoint)

    def status(self, _sid: str) -> str:
        return self.ends


def test_another_ray_version_or_a_data_dir_the_cluster_cannot_see_is_refused(tmp_path):
    import ray

    server = HTTPServer(("127.0.0.1", 0), _Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    s = settings(tmp_path, RAY_ADDRESS=url)
    try:
        with pytest.raises(SettingsError, match=r"runs Ray 0\.0\.1.*the same version"):
            check_cluster(s, _Launcher(url, "SUCCEEDED"))
        _Dashboard.version = ray.__version__
        ok = _Launcher(url, "SUCCEEDED")
        check_cluster(s, ok)
        # the probe ran the marker check, and left no marker behind
        assert len(ok.submitted) == 1
        assert str(tmp_path) in ok.submitted[0]
        assert not list(tmp_path.glob(".probe-*"))
        with pytest.raises(SettingsError, match="does not see the data dir"):
            check_cluster(s, _Launcher(url, "FAILED"))
    finally:
        server.shutdown()
