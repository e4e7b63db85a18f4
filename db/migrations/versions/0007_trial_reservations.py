"""Who reserved a trial and when, in columns of their own: ``kato_trials.reserved_by`` and
``reserved_at``.

Before this revision a reservation (a placeholder row a worker inserts before it measures a
config, :mod:`db.ledger`) named its worker in the row's ``error`` text ("being measured by
worker <id>"), parsed back by every reader. The upgrade moves each such name into
``reserved_by`` (``reserved_at``: the placeholder's ``created_at``, when it was inserted) and
clears the text; recorded rows keep their error and get no reserver (unknown before this
revision). The downgrade writes the text back for the placeholders and drops the columns.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The status of a placeholder row and the text that named its worker before this revision.
RESERVED = "running"
RESERVED_BY_TEXT = "being measured by worker "

# Frozen table stub: migrations never import the live models.
_trials = sa.table(
    "kato_trials",
    sa.column("id", sa.Integer),
    sa.column("status", sa.String),
    sa.column("error", sa.Text),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("reserved_by", sa.String),
    sa.column("reserved_at", sa.DateTime(timezone=True)),
)


def move_reservers_to_columns(connection: sa.Connection) -> int:
    """Set ``reserved_by`` / ``reserved_at`` of every placeholder whose error text names its
    worker, and clear that text; the count of rows changed."""
    rows = connection.execute(
        sa.select(_trials.c.id, _trials.c.error, _trials.c.created_at).where(
            _trials.c.status == RESERVED, _trials.c.error.is_not(None)
        )
    ).all()
    changes = [
        {"trial_id": row.id, "by": row.error[len(RESERVED_BY_TEXT) :], "at": row.created_at}
        for row in rows
        if row.error.startswith(RESERVED_BY_TEXT)  # in Python: LIKE would read "_" as a wildcard
    ]
    if changes:
        connection.execute(
            _trials.update()
            .where(_trials.c.id == sa.bindparam("trial_id"))
            .values(reserved_by=sa.bindparam("by"), reserved_at=sa.bindparam("at"), error=None),
            changes,
        )
    return len(changes)


def upgrade() -> None:
    with op.batch_alter_table("kato_trials") as batch:
        batch.add_column(sa.Column("reserved_by", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("reserved_at", sa.DateTime(timezone=True), nullable=True))
    move_reservers_to_columns(op.get_bind())


def downgrade() -> None:
    op.get_bind().execute(
        _trials.update()
        .where(_trials.c.status == RESERVED, _trials.c.reserved_by.is_not(None))
        .values(error=sa.literal(RESERVED_BY_TEXT) + _trials.c.reserved_by)
    )
    with op.batch_alter_table("kato_trials") as batch:
        batch.drop_column("reserved_at")
        batch.drop_column("reserved_by")
