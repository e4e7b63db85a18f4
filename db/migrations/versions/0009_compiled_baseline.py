"""The compiled framework baseline beside a winner: ``kato_best_configs.compiled_ms`` (PyTorch's
op compiled by ``torch.compile``, Inductor, timed as ``framework_ms`` is) and ``compiled`` (what
it timed, e.g. "torch.compile 2.14.1 inductor"). Both nullable: rows written before this
revision have neither (the policy then keeps its eager rule for compiled graphs).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("kato_best_configs") as batch:
        batch.add_column(sa.Column("compiled_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("compiled", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kato_best_configs") as batch:
        batch.drop_column("compiled")
        batch.drop_column("compiled_ms")
