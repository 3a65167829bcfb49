"""A tenant's training runs and their checkpoints, read from its root on the shared volume
(`<data dir>/sessions/<tenant>/`), so they outlive the sessions and the control plane.

A training run is a training model (`<session>:train:<n>`); its directory holds
`run.json` (base model, LoRA rank, when it started) and its checkpoints:
`weights/<name>` (save_state: the engine's checkpoint) and `sampler_weights/<name>` (an
adapter or a model), each with a `session.json` (what it was trained from, when it was
written, when it expires, the caller's metadata). A checkpoint's id is
`weights/<name>` or `sampler_weights/<name>`, as in its `tinker://` path.

What a tenant keeps here counts in its storage quota (service.control.storage); a
checkpoint saved with `ttl_seconds` is removed by the reconciler's sweep once it expires.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest, NotFound

KINDS = {"weights": "training", "sampler_weights": "sampler"}
# tinker://<run id>/<kind>/<name>: neither id nor name holds a '/' or starts with a '.'
TINKER_PATH_RE = re.compile(
    r"^tinker://(?P<run>[A-Za-z0-9][A-Za-z0-9:._-]*)/(?P<kind>[a-z_]+)/"
    r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)$"
)
META = "session.json"
RUN = "run.json"
TTL_RANGE_S = (3600, 10 * 365 * 86_400)  # Tinker's: an hour to ten years


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def write_run(root: Path, model_id: str, base_model: str, rank: int) -> None:
    where = root / model_id
    if (where / RUN).is_file():
        return
    where.mkdir(parents=True, exist_ok=True)
    meta = {"base_model": base_model, "rank": rank, "created": time.time()}
    (where / RUN).write_text(json.dumps(meta))


def check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and not TTL_RANGE_S[0] <= ttl_seconds <= TTL_RANGE_S[1]:
        raise InvalidRequest(
            f"ttl_seconds {ttl_seconds}: give {TTL_RANGE_S[0]} (an hour) to {TTL_RANGE_S[1]} "
            "(ten years), or none to keep it until deleted",
            param="ttl_seconds",
        )


def meta_for(
    base_model: str,
    rank: int,
    targets: list[str],
    ttl_seconds: int | None,
    user_metadata: dict[str, str] | None,
) -> dict[str, Any]:
    """What a checkpoint's `session.json` says of it."""
    now = time.time()
    check_ttl(ttl_seconds)
    return {
        "base_model": base_model,
        "rank": rank,
        "targets": targets,
        "created": now,
        "expires_at": now + ttl_seconds if ttl_seconds else None,
        "user_metadata": user_metadata or None,
    }


@dataclass(frozen=True)
class Checkpoint:
    run: str
    kind: str  # weights | sampler_weights
    name: str
    created: float
    size_bytes: int
    expires_at: float | None
    user_metadata: dict[str, str] | None

    @property
    def type(self) -> str:
        return KINDS[self.kind]

    def wire(self) -> dict[str, Any]:
        """As the SDK reads it (`tinker.types.Checkpoint`)."""
        return {
            "checkpoint_id": f"{self.kind}/{self.name}",
            "checkpoint_type": self.type,
            "time": iso(self.created),
            "tinker_path": f"tinker://{self.run}/{self.kind}/{self.name}",
            "size_bytes": self.size_bytes,
            "public": False,
            "user_metadata": self.user_metadata,
            "expires_at": iso(self.expires_at) if self.expires_at else None,
        }


def locate(root: Path, path: str, kind: str) -> Path | None:
    """The directory of a `tinker://<run>/<kind>/<name>` checkpoint under `root` (the
    caller's own), or None: another kind, a malformed path, nothing saved there."""
    m = TINKER_PATH_RE.match(path)
    if m is None or m["kind"] != kind:
        return None
    where = root / m["run"] / kind / m["name"]
    return where if (where / META).is_file() else None


def _checkpoint(run: str, kind: str, d: Path) -> Checkpoint | None:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        return None  # being written, or not a checkpoint
    from service.control.storage import du

    created = meta.get("created") or (d / META).stat().st_mtime
    return Checkpoint(
        run, kind, d.name, created, du(d), meta.get("expires_at"), meta.get("user_metadata")
    )


def checkpoints(root: Path, run: str) -> list[Checkpoint]:
    """A run's checkpoints, newest first."""
    out = []
    for kind in KINDS:
        for d in sorted((root / run / kind).glob("*")):
            c = _checkpoint(run, kind, d)
            if c is not None:
                out.append(c)
    out.sort(key=lambda c: -c.created)
    return out


def run_ids(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob(f"*/{RUN}"))


def training_run(root: Path, tenant: str, run: str, last_seen: float | None) -> dict[str, Any]:
    try:
        meta = json.loads((root / run / RUN).read_text())
    except (OSError, ValueError):
        raise NotFound("training run", run, param="training_run_id") from None
    ckpts = checkpoints(root, run)
    last = {t: next((c.wire() for c in ckpts if c.type == t), None) for t in KINDS.values()}
    seen = last_seen or max([meta["created"], *(c.created for c in ckpts)])
    return {
        "training_run_id": run,
        "base_model": meta["base_model"],
        "model_owner": tenant,
        "is_lora": meta["rank"] > 0,
        "corrupted": False,
        "lora_rank": meta["rank"] or None,
        "last_request_time": iso(seen),
        "last_checkpoint": last["training"],
        "last_sampler_checkpoint": last["sampler"],
        "user_metadata": None,
    }


def delete(root: Path, run: str, checkpoint_id: str) -> None:
    kind, _, name = checkpoint_id.partition("/")
    d = root / run / kind / name
    if kind not in KINDS or not name or "/" in name or not (d / META).is_file():
        raise NotFound("checkpoint", f"{run}/{checkpoint_id}", param="checkpoint_id")
    shutil.rmtree(d)


def expire(sessions_root: Path, now: float | None = None) -> list[Path]:
    """Remove every tenant's checkpoints past their `expires_at`; what was removed."""
    now = time.time() if now is None else now
    gone = []
    for meta_path in sessions_root.glob(f"*/*/*/*/{META}"):
        try:
            expires = json.loads(meta_path.read_text()).get("expires_at")
        except (OSError, ValueError):
            continue
        if expires is not None and expires < now:
            shutil.rmtree(meta_path.parent, ignore_errors=True)
            gone.append(meta_path.parent)
    return gone
