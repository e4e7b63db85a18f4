"""Workers (heartbeats, GPU models), API tokens, and the token that submitted a job.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of db.models.UTCDateTime's storage type: migrations never import the live models.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "kato_workers",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("gpu_models", sa.JSON(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("current_job_id", sa.String(length=32), nullable=True),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("heartbeat_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kato_workers")),
    )
    op.create_index(
        op.f("ix_kato_workers_heartbeat_at"), "kato_workers", ["heartbeat_at"], unique=False
    )
    op.create_table(
        "kato_api_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("max_queued_jobs", sa.Integer(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("last_used_at", TIMESTAMP, nullable=True),
        sa.Column("revoked_at", TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kato_api_tokens")),
        sa.UniqueConstraint("secret_sha256", name=op.f("uq_kato_api_tokens_secret_sha256")),
    )
    with op.batch_alter_table("kato_jobs") as batch:
        batch.add_column(sa.Column("token_id", sa.String(length=32), nullable=True))
        batch.create_index(batch.f("ix_kato_jobs_token_id"), ["token_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("kato_jobs") as batch:
        batch.drop_index(batch.f("ix_kato_jobs_token_id"))
        batch.drop_column("token_id")
    op.drop_table("kato_api_tokens")
    op.drop_index(op.f("ix_kato_workers_heartbeat_at"), table_name="kato_workers")
    op.drop_table("kato_workers")
