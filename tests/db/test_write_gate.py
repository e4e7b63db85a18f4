"""SQLite writers of one engine queue on its gate (db.write_gate): a burst of concurrent writers
under a short lock limit all commit (in SQLite's busy handler some would wait past it), a
writer that holds the gate too long makes the others fail as "database is locked" within the
limit (a transient fault: 503 busy in the API), and a thread never waits for itself."""

from __future__ import annotations

import threading
import time

import pytest
from kato.db import retry
from kato.db.session import DbTimeouts, init_db, make_engine
from kato.service.faults import database_fault
from sqlalchemy import text


@pytest.fixture
def engine(tmp_path):
    engine = init_db(make_engine(f"sqlite:///{tmp_path / 'kato.db'}", timeouts=DbTimeouts(lock=1)))
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE t (x INTEGER)"))
    yield engine
    engine.dispose()


def test_a_burst_of_writers_all_commit_within_a_short_lock_limit(engine) -> None:
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for _ in range(5):
                with engine.begin() as connection:
                    connection.execute(text("INSERT INTO t VALUES (:x)"), {"x": i})
                    time.sleep(0.005)  # a transaction that does some work while it writes
        except BaseException as error:  # noqa: BLE001 - collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM t")).scalar() == 200


def test_a_writer_holding_the_gate_past_the_limit_makes_others_fail_busy(engine) -> None:
    holder = engine.connect()
    holder.execute(text("INSERT INTO t VALUES (1)"))  # takes the gate, keeps its transaction
    caught: list[BaseException] = []

    def write() -> None:
        try:
            with engine.begin() as connection:
                connection.execute(text("INSERT INTO t VALUES (2)"))
        except Exception as error:
            caught.append(error)

    start = time.monotonic()
    thread = threading.Thread(target=write)
    thread.start()
    thread.join(10)
    seconds = time.monotonic() - start
    holder.rollback()
    holder.close()
    assert len(caught) == 1 and 0.9 < seconds < 3, (caught, seconds)
    assert retry.is_transient(caught[0])
    fault = database_fault(caught[0])
    assert fault is not None and fault.kind == "busy"
    with engine.begin() as connection:  # the gate came free with the rollback
        connection.execute(text("INSERT INTO t VALUES (3)"))


def test_a_thread_holding_the_gate_does_not_wait_for_itself(engine) -> None:
    first = engine.connect()
    first.execute(text("INSERT INTO t VALUES (1)"))
    first.commit()
    first.execute(text("INSERT INTO t VALUES (2)"))  # holds the gate again
    start = time.monotonic()
    second = engine.connect()
    try:
        # SQLite's own lock still serialises: the second connection waits in the busy
        # handler, and fails there, not on a gate held by its own thread
        with pytest.raises(Exception, match="database is locked"):
            second.execute(text("INSERT INTO t VALUES (3)"))
    finally:
        second.close()
        first.rollback()
        first.close()
    assert time.monotonic() - start < 3
