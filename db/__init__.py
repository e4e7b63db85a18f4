"""Kato's database layer: SQLAlchemy 2.0 models, engines and sessions, queries, migrations.

Typical use (service, worker, CLI)::

    from kato.db import init_db, queries, session_factory

    engine = init_db(url)  # migrates the schema to head; a no-op when current
    sessions = session_factory(engine)
    with sessions() as session:
        job = queries.claim_next_job(session, gpu_models=["H200"], worker_id="w1",
                                     lease_seconds=60)

A worker takes part in jobs only through :mod:`db.ledger` (claims, reservations, results, the
job's end), which owns its sessions and retries.
"""

from kato.db import queries
from kato.db.models import Base, BestConfig, Job, Trial
from kato.db.session import default_db_url, init_db, make_engine, normalize_db_url, session_factory

__all__ = [
    "Base",
    "BestConfig",
    "Job",
    "Trial",
    "default_db_url",
    "init_db",
    "make_engine",
    "normalize_db_url",
    "queries",
    "session_factory",
]
