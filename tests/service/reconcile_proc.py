"""A control plane's reconciler as its own process, for crash tests: `python -m
tests.service.reconcile_proc DB_URL DATA_DIR RAY_FILE TICKS`. Ray is a JSON file (each
submission id with its state and how many times it was submitted), so what "Ray" was told
survives the SIGKILL a crash point (`PSTAR_CRASH_AT`) sends this process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from service.control.launcher import DryLauncher


class FileRay(DryLauncher):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"state": {}, "submits": {}}

    def _write(self, d: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(d))
        os.replace(tmp, self.path)

    def submit(self, submission_id, job_id, attempt, env) -> None:
        d = self._read()
        # every call counts, also one Ray refuses: the tests hold each at one
        d["submits"][submission_id] = d["submits"].get(submission_id, 0) + 1
        exists = submission_id in d["state"]
        d["state"].setdefault(submission_id, "PENDING")
        self._write(d)
        if exists:
            raise RuntimeError(f"submission {submission_id} exists")  # as Ray refuses it

    def status(self, submission_id: str) -> str | None:
        return self._read()["state"].get(submission_id)

    def statuses(self, submission_ids) -> dict[str, str]:
        return {k: v for k, v in self._read()["state"].items() if k in submission_ids}

    def stop_quietly(self, submission_id: str) -> None:
        d = self._read()
        if submission_id in d["state"]:
            d["state"][submission_id] = "STOPPED"
            self._write(d)


def main(argv: list[str]) -> None:
    from service.control.reconciler import Reconciler
    from service.settings import Settings
    from service.store import Store

    db_url, data_dir, ray_file, ticks = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    store = Store(db_url)
    settings = Settings(data_dir=data_dir, db_url=db_url, tokens={})
    rec = Reconciler(settings, store, FileRay(ray_file))
    for _ in range(ticks):
        rec.tick()
    store.close()


if __name__ == "__main__":
    main(sys.argv[1:])
