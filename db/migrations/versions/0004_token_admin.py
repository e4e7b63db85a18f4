"""Admin API tokens: ``kato_api_tokens.admin`` (false for every existing token).

An admin token may cancel any job through ``DELETE /v1/jobs/{id}`` (the jobs of a revoked token
included); ordinary tokens cancel their own jobs and tokenless ones, as before.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("kato_api_tokens") as batch:
        batch.add_column(
            sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("kato_api_tokens") as batch:
        batch.drop_column("admin")
