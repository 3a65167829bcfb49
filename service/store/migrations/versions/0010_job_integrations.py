"""jobs.integrations: each experiment tracker's run as the driver started it (its type,
run id, URL, and whether it is logging, finished or failed, with why); and the events
the driver wrote at level "warning" get OpenAI's "warn"

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("integrations", sa.JSON(), nullable=True))
    # the driver wrote "warning" for a memory plan that does not fit; the API answers
    # OpenAI's levels only (info, warn, error), and now every event is made with one
    op.execute("UPDATE events SET level = 'warn' WHERE level = 'warning'")


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("integrations")
