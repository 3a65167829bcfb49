"""Checks `pstar serve` makes before it serves: deployments that would accept jobs and
then lose them are refused at start, saying what to set (`pstar serve` exits 2).

- the store is SQLite (a file on this machine) and Ray is a cluster elsewhere: its
  drivers would open an empty database of their own and every job would fail;
- the cluster runs another Ray version than this control plane: job submission and the
  state API change between versions;
- the cluster cannot see the data dir (uploads, runs and exports live there): a probe
  job on the cluster looks for a file the control plane has just written.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
import shlex
import socket
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from service import ray_auth
from service.settings import Settings, SettingsError

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 120.0


def is_local_address(address: str) -> bool:
    """Whether a Ray address (`http://host:8265`, `host:6379`, `ray://host`) is this machine."""
    host = urlsplit(address if "://" in address else f"x://{address}").hostname or ""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_store(settings: Settings) -> None:
    remote = settings.ray_address and not is_local_address(settings.ray_address)
    if remote and settings.db_url.startswith("sqlite"):
        raise SettingsError(
            f"PSTAR_DB_URL is SQLite (a file on this machine) but RAY_ADDRESS="
            f"{settings.ray_address} is a cluster elsewhere: its drivers would open an "
            "empty database of their own. Set PSTAR_DB_URL (or PSTAR_DB_URL_FILE) to a "
            "PostgreSQL URL the cluster's nodes reach"
        )


def check_cluster(settings: Settings, launcher: Any, probe: bool = True) -> None:
    """The Ray version of the cluster at `launcher`, and (with `probe`) that its drivers
    see the data dir. Only for a cluster this control plane did not start."""
    import ray

    ours = ray.__version__
    theirs = _cluster_ray_version(launcher)
    if theirs is not None and theirs != ours:
        raise SettingsError(
            f"the Ray cluster at {settings.ray_address} runs Ray {theirs}, this control plane "
            f"Ray {ours}: run the same version on both (the image's, pip install ray=={theirs})"
        )
    if probe:
        _probe_data_dir(settings, launcher)


def _cluster_ray_version(launcher: Any) -> str | None:
    url = getattr(launcher, "dashboard_url", None)
    if not url:
        return None
    try:
        req = urllib.request.Request(f"{url}/api/version", headers=ray_auth.headers())
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read()).get("ray_version")
    except (OSError, ValueError):
        return None  # not reachable now: the reconciler waits for it, /readyz says so


def _probe_data_dir(settings: Settings, launcher: Any) -> None:
    token = secrets.token_hex(8)
    marker = settings.data_dir / f".probe-{token}"
    marker.write_text(token)
    sid = f"pstar-probe-{token}"
    code = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
        "sys.exit(0 if p.is_file() and p.read_text() == sys.argv[2] else 3)"
    )
    entry = f"{shlex.quote(launcher.python)} -c {shlex.quote(code)} {shlex.quote(str(marker))} "
    entry += token
    try:
        launcher.client().submit_job(entrypoint=entry, submission_id=sid, entrypoint_num_cpus=0)
        deadline = time.time() + PROBE_TIMEOUT_S
        status = None
        while time.time() < deadline:
            status = launcher.status(sid)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.5)
    except Exception as e:
        log.warning("could not probe the cluster for the data dir (%s); going on", e)
        return
    finally:
        marker.unlink(missing_ok=True)
    if status == "SUCCEEDED":
        return
    if status in ("FAILED", "STOPPED"):
        raise SettingsError(
            f"the Ray cluster at {settings.ray_address} does not see the data dir "
            f"{settings.data_dir} (a probe job found no file there): mount the same volume "
            "on the cluster's nodes at the same path, and set PSTAR_DATA_DIR to it"
        )
    log.warning("the data dir probe did not finish in %.0f s; going on", PROBE_TIMEOUT_S)
