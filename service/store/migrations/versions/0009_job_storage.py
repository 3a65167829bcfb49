"""jobs.storage_bytes and jobs.run_reclaimed_at: what an ended job keeps on the shared
volume (its run directory: checkpoints, prepared data; and its exported model), measured
when it ended and whenever that changes, counted against its tenant's storage quota; and
when retention reclaimed its run directory

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("storage_bytes", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("run_reclaimed_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("run_reclaimed_at")
        batch_op.drop_column("storage_bytes")
