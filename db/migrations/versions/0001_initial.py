"""Initial schema: jobs, trials, best configs.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of db.models.UTCDateTime's storage type: migrations never import the live models.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "kato_jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("operator", sa.String(length=64), nullable=False),
        sa.Column("operator_version", sa.String(length=64), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("shape_key", sa.String(length=255), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("gpu_model", sa.String(length=64), nullable=False),
        sa.Column("budget_configs", sa.Integer(), nullable=False),
        sa.Column("budget_seconds", sa.Float(), nullable=True),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("trials_done", sa.Integer(), nullable=False),
        sa.Column("best_time_ms", sa.Float(), nullable=True),
        sa.Column("best_config", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_kato_jobs"),
    )
    op.create_index("ix_kato_jobs_claim", "kato_jobs", ["status", "gpu_model", "created_at"])

    op.create_table(
        "kato_best_configs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("operator", sa.String(length=64), nullable=False),
        sa.Column("operator_version", sa.String(length=64), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=False),
        sa.Column("shape_key", sa.String(length=255), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("gpu_model", sa.String(length=64), nullable=False),
        sa.Column("compute_capability", sa.String(length=16), nullable=False),
        sa.Column("cuda_version", sa.String(length=32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["kato_jobs.id"],
            name="fk_kato_best_configs_job_id_kato_jobs",
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_kato_best_configs"),
        sa.UniqueConstraint(
            "operator",
            "operator_version",
            "shape_key",
            "dtype",
            "gpu_model",
            "compute_capability",
            "cuda_version",
            name="uq_kato_best_configs_key",
        ),
    )
    op.create_index(
        "ix_kato_best_configs_lookup", "kato_best_configs", ["operator", "dtype", "gpu_model"]
    )

    op.create_table(
        "kato_trials",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("config_key", sa.String(length=1024), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=True),
        sa.Column("times_ms", sa.JSON(), nullable=False),
        sa.Column("compile_time_s", sa.Float(), nullable=True),
        sa.Column("registers", sa.Integer(), nullable=True),
        sa.Column("shared_static_bytes", sa.Integer(), nullable=True),
        sa.Column("shared_dynamic_bytes", sa.Integer(), nullable=True),
        sa.Column("local_bytes", sa.Integer(), nullable=True),
        sa.Column("blocks_per_sm", sa.Integer(), nullable=True),
        sa.Column("occupancy", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["kato_jobs.id"],
            name="fk_kato_trials_job_id_kato_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_kato_trials"),
        sa.UniqueConstraint("job_id", "config_key", name="uq_kato_trials_job_id_config_key"),
    )
    op.create_index("ix_kato_trials_job_id", "kato_trials", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_kato_trials_job_id", table_name="kato_trials")
    op.drop_table("kato_trials")
    op.drop_index("ix_kato_best_configs_lookup", table_name="kato_best_configs")
    op.drop_table("kato_best_configs")
    op.drop_index("ix_kato_jobs_claim", table_name="kato_jobs")
    op.drop_table("kato_jobs")
