"""jobs.pause_requested, jobs.pauses: pausing a job at a step boundary and resuming it
(attempts ended by a pause do not count against max_attempts); jobs.early_stopping: its
settings and what it found; jobs.data_report: the prepared data (rows, fill, packing)

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("pause_requested", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("pauses", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("early_stopping", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("data_report", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("data_report")
        batch_op.drop_column("early_stopping")
        batch_op.drop_column("pauses")
        batch_op.drop_column("pause_requested")
