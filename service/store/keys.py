"""`store.keys`: API keys an operator makes, kept as the SHA-256 of their secret.

A key's secret is random (32 bytes), so a plain SHA-256 is what it takes: nobody can find
a secret from its hash, and a lookup by hash tells a caller nothing about other keys. The
secret is returned once, by `create`, and never stored or logged. Secrets start with
`tml-`: the Tinker SDK refuses keys that do not.
"""

from __future__ import annotations

import builtins
import hashlib
import secrets
import time

from sqlalchemy import select, update

from service.store.db import Resource
from service.store.models import ApiKey

ROLES = ("tenant", "admin", "grader")
# a reinforcement job's own key, for its score_model graders' questions (chat completions
# and nothing else: api.auth); made and revoked by the control plane
# (service.control.grader_access), never by an operator
GRADER = "grader"
ADMIN_TENANT = "~admin"  # the tenant of every admin key: it owns no files or jobs


def key_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Keys(Resource):
    def create(self, tenant: str, role: str = "tenant", name: str = "") -> tuple[ApiKey, str]:
        """A new key of `tenant` with `role` (an admin key's tenant is `ADMIN_TENANT`);
        (its row, its secret: shown this once)."""
        if role not in ROLES:
            raise ValueError(f"a key's role is one of {ROLES}, got {role!r}")
        if role == "admin":
            tenant = ADMIN_TENANT
        secret = "tml-" + secrets.token_urlsafe(32)
        key = ApiKey(
            id="key-" + secrets.token_hex(8),
            tenant=tenant,
            role=role,
            name=name,
            hash=key_hash(secret),
            hint=secret[-4:],
            created_at=int(time.time()),
        )
        with self.db.write() as s:
            s.add(key)
        return key, secret

    def find(self, secret: str) -> ApiKey | None:
        """The live (unrevoked) key whose secret this is, or None."""
        with self.db.read() as s:
            return s.scalar(
                select(ApiKey).where(ApiKey.hash == key_hash(secret), ApiKey.revoked_at.is_(None))
            )

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if tenant is not None:
            q = q.where(ApiKey.tenant == tenant)
        with self.db.read() as s:
            return list(s.scalars(q))

    def live(self, role: str) -> builtins.list[ApiKey]:
        """The unrevoked keys of `role`."""
        q = select(ApiKey).where(ApiKey.role == role, ApiKey.revoked_at.is_(None))
        with self.db.read() as s:
            return list(s.scalars(q))

    def revoke(self, key_id: str) -> ApiKey | None:
        """Revoke a key (once; a revoked key stays listed, revoked); the key, or None."""
        with self.db.write() as s:
            s.execute(
                update(ApiKey)
                .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                .values(revoked_at=int(time.time()))
            )
            return s.get(ApiKey, key_id)
