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


def upgrade() -> None:
    with op.batch_alter_table("kato_jobs") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("gpu_busy_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("gpu_busy_fraction", sa.Float(), nullable=True))
        batch.create_index(batch.f("ix_kato_jobs_batch_id"), ["batch_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("kato_jobs") as batch:
        batch.drop_index(batch.f("ix_kato_jobs_batch_id"))
        batch.drop_column("gpu_busy_fraction")
        batch.drop_column("gpu_busy_s")
        batch.drop_column("batch_id")
