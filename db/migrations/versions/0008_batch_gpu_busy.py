"""A job's batch and its GPU busy time: ``kato_jobs.batch_id`` (the batch it was submitted in,
``POST /v1/jobs/batch``, indexed for ``GET /v1/jobs/batch/{id}``), ``gpu_busy_s`` (seconds the
GPU was held for its measurements) and ``gpu_busy_fraction`` (that over the job's wall time).
All nullable: jobs written before this revision have none of them.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


#: Plain ALTER TABLE statements, not a batch: on SQLite a batch recreates ``kato_jobs``, and
#: dropping the old table deletes every trial through ``kato_trials``' ON DELETE CASCADE.
_COLUMNS = ("batch_id", "gpu_busy_s", "gpu_busy_fraction")


def upgrade() -> None:
    op.add_column("kato_jobs", sa.Column("batch_id", sa.String(length=32), nullable=True))
    op.add_column("kato_jobs", sa.Column("gpu_busy_s", sa.Float(), nullable=True))
    op.add_column("kato_jobs", sa.Column("gpu_busy_fraction", sa.Float(), nullable=True))
    op.create_index("ix_kato_jobs_batch_id", "kato_jobs", ["batch_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_kato_jobs_batch_id", table_name="kato_jobs")
    for column in reversed(_COLUMNS):  # SQLite 3.35+ drops a column in place
        op.execute(f"ALTER TABLE kato_jobs DROP COLUMN {column}")
