"""jobs.workers, jobs.gpus: what a running job takes of its tenant's share; an index of
a tenant's jobs by status (its unfinished jobs are counted at every create)

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("workers", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("gpus", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", table_name="jobs")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("gpus")
        batch_op.drop_column("workers")
