"""`store.files`: the tenant's uploaded files and the results files jobs write."""

from __future__ import annotations

from sqlalchemy import func, select

from service.store import statements
from service.store.db import Resource
from service.store.models import UNFINISHED, File, Job


class Files(Resource):
    def add(self, f: File) -> File:
        with self.db.write() as s:
            s.add(f)
        return f

    def get(self, tenant: str, file_id: str) -> statements.View | None:
        """The file's row (the attributes of `File`, read-only), or None."""
        with self.db.reading() as conn:
            return statements.file(conn, tenant, file_id)

    def page(
        self, tenant: str, after: str | None, limit: int, purpose: str | None, order: str = "desc"
    ) -> tuple[list[File], bool]:
        q = select(File).where(File.tenant == tenant)
        if purpose:
            q = q.where(File.purpose == purpose)
        desc = order == "desc"
        if after:
            cursor = self.db.cursor(File, after, "file", File.tenant == tenant)
            q = q.where(File.seq < cursor if desc else File.seq > cursor)
        q = q.order_by(File.seq.desc() if desc else File.seq.asc()).limit(limit + 1)
        with self.db.read() as s:
            rows = list(s.scalars(q))
        return rows[:limit], len(rows) > limit

    def delete(self, tenant: str, file_id: str) -> File | None:
        with self.db.write() as s:
            f = s.scalar(select(File).where(File.id == file_id, File.tenant == tenant))
            if f is not None:
                s.delete(f)
            return f

    def in_use(self, tenant: str, file_id: str) -> str | None:
        """The id of an unfinished job that trains on this file, if any."""
        with self.db.read() as s:
            return s.scalar(
                select(Job.id)
                .where(Job.tenant == tenant, Job.status.in_(UNFINISHED))
                .where((Job.training_file == file_id) | (Job.validation_file == file_id))
                .limit(1)
            )

    def total_bytes(self, tenant: str) -> int:
        """What the tenant's stored files take (results files included)."""
        with self.db.read() as s:
            return int(s.scalar(select(func.sum(File.bytes)).where(File.tenant == tenant)) or 0)
