"""jobs.memory_plan: the capacity planner's plan of the job on its cluster (per rank: the
chunk lists per tier at start, one iteration's peaks and bytes moved, and for a job that
does not fit, the smallest change that would), written by the driver once the data is
prepared

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("memory_plan", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("memory_plan")
