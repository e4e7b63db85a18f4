"""Trial numbers unique per job: renumber repeats, then a unique constraint on (job_id, number).

Workers sharing a job could give two trials the same number (and skip others) when one of them
died holding reservations. Before the constraint is added, every job holding a repeated number
is renumbered densely from 0 in the order (number, id): the trials keep their relative order,
the first stored of two equal numbers keeps its place, and the gaps close. Jobs without repeats
are left as they are.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CONSTRAINT = "uq_kato_trials_job_id_number"

# Frozen table stub: migrations never import the live models.
_trials = sa.table(
    "kato_trials",
    sa.column("id", sa.Integer),
    sa.column("job_id", sa.String),
    sa.column("number", sa.Integer),
)


def renumber_repeats(connection: sa.Connection) -> int:
    """Renumber the trials of every job holding a repeated number; the count of rows changed."""
    repeated = (
        sa.select(_trials.c.job_id)
        .group_by(_trials.c.job_id, _trials.c.number)
        .having(sa.func.count() > 1)
        .distinct()
    )
    rows = connection.execute(
        sa.select(_trials.c.id, _trials.c.job_id, _trials.c.number)
        .where(_trials.c.job_id.in_(repeated))
        .order_by(_trials.c.job_id, _trials.c.number, _trials.c.id)
    ).all()
    changes: list[dict[str, int]] = []
    job_id, next_number = None, 0
    for row in rows:
        if row.job_id != job_id:
            job_id, next_number = row.job_id, 0
        if row.number != next_number:
            changes.append({"trial_id": row.id, "new_number": next_number})
        next_number += 1
    if changes:
        connection.execute(
            _trials.update()
            .where(_trials.c.id == sa.bindparam("trial_id"))
            .values(number=sa.bindparam("new_number")),
            changes,
        )
    return len(changes)


def upgrade() -> None:
    renumber_repeats(op.get_bind())
    with op.batch_alter_table("kato_trials") as batch:
        batch.create_unique_constraint(CONSTRAINT, ["job_id", "number"])


def downgrade() -> None:
    with op.batch_alter_table("kato_trials") as batch:
        batch.drop_constraint(CONSTRAINT, type_="unique")
