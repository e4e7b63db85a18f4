"""User operators registered at runtime (``kato_user_operators``), and the token scope that
allows registering them (``kato_api_tokens.operators``, false for every existing token).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of db.models.UTCDateTime's storage type: migrations never import the live models.
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "kato_user_operators",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=12), nullable=False),
        sa.Column("definition", sa.JSON(), nullable=False),
        sa.Column("token_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kato_user_operators")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_kato_user_operators_name_version")),
    )
    op.create_index(
        op.f("ix_kato_user_operators_name"), "kato_user_operators", ["name"], unique=False
    )
    with op.batch_alter_table("kato_api_tokens") as batch:
        batch.add_column(
            sa.Column("operators", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("kato_api_tokens") as batch:
        batch.drop_column("operators")
    op.drop_index(op.f("ix_kato_user_operators_name"), table_name="kato_user_operators")
    op.drop_table("kato_user_operators")
