"""Figures stored beside a winner: the default config's time on the key's shape
(``default_ms``), PyTorch's own op on the same inputs (``framework_ms``) and which framework
that was (``framework``, e.g. "torch 2.13.0+cu130"). All nullable: rows written before this
revision have none of them (a lookup then serves such a row for another shape no more: it is
not known to beat the default there).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("kato_best_configs") as batch:
        batch.add_column(sa.Column("default_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("framework_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("framework", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kato_best_configs") as batch:
        batch.drop_column("framework")
        batch.drop_column("framework_ms")
        batch.drop_column("default_ms")
