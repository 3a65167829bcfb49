"""jobs.model_deleted_at: when the tenant deleted the job's fine-tuned model
(`DELETE /v1/models/{model}`); the job keeps its record, the model is no longer listed,
served or fine-tuned from, and its files go once no unfinished job still reads them

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model_deleted_at", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("model_deleted_at")
