"""The write-behind queue: ordered background writes, held until released, failures raised
in the submitting thread; and the search that uses it."""

from __future__ import annotations

import logging
import threading
import time

import optuna
import pytest
from kato.tuner.search import Budget, Search
from kato.tuner.write_behind import WriteBehind

from tests.tuner.test_search import Counter, make_space


def _disk_full() -> None:
    """A write that fails."""
    raise OSError("disk full")


def test_writes_wait_for_release_then_run_in_order_on_another_thread():
    writes = WriteBehind(True)
    done: list[tuple[int, str]] = []

    def write(i: int) -> None:
        done.append((i, threading.current_thread().name))

    for i in range(5):
        writes.submit(write, i)
    assert done == []  # held: the search is still proposing
    writes.release()
    writes.flush()
    assert [i for i, _ in done] == [0, 1, 2, 3, 4]
    assert all(name.startswith("kato-write-behind") for _, name in done)
    writes.submit(write, 5)
    writes.close(raise_errors=True)  # close releases and waits
    assert [i for i, _ in done] == [0, 1, 2, 3, 4, 5]


def test_disabled_writes_run_at_once_in_the_callers_thread():
    writes = WriteBehind(False)
    done: list[str] = []
    writes.submit(lambda: done.append(threading.current_thread().name))
    assert done == [threading.current_thread().name]


def test_a_failed_write_is_raised_by_the_next_release_and_the_later_writes_still_run():
    writes = WriteBehind(True)
    done: list[int] = []
    writes.submit(_disk_full)
    writes.submit(done.append, 1)
    writes.release()
    writes.flush(raise_errors=False)  # logged; both ran
    assert done == [1]
    writes.submit(_disk_full)
    writes.submit(done.append, 2)
    writes.release()
    with pytest.raises(OSError, match="disk full"):
        writes.flush()
    assert done == [1, 2]
    writes.submit(_disk_full)
    writes.release()
    with pytest.raises(OSError, match="disk full"):
        writes.release()  # the next release waits for it and reports it
    writes.close(raise_errors=True)


def test_writes_held_behind_a_failure_still_run():
    writes = WriteBehind(True)
    done: list[int] = []
    writes.submit(_disk_full)
    writes.release()
    writes.submit(done.append, 1)
    with pytest.raises(OSError, match="disk full"):
        writes.flush()
    assert done == [1]
    writes.close(raise_errors=True)


def test_close_without_raising_logs_the_failure(caplog):
    writes = WriteBehind(True)
    writes.submit(lambda: 1 / 0)
    with caplog.at_level(logging.ERROR, logger="kato.tuner.write_behind"):
        writes.close()
    assert "background write failed" in caplog.text
    assert "ZeroDivisionError" in caplog.text


@pytest.mark.parametrize("strategy", ["forest", "tpe"])
def test_a_search_with_write_behind_records_everything_before_it_returns(tmp_path, strategy):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    seen: list[tuple[int, str]] = []
    main = threading.current_thread()

    def on_result(result, measured: int) -> None:
        seen.append((measured, threading.current_thread().name))

    def run(write_behind: bool, name: str):
        return Search(
            make_space(),
            Counter(),
            strategy=strategy,
            seed=7,
            storage=storage,
            study_name=name,
            on_result=on_result,
            write_behind=write_behind,
        ).run(Budget(max_configs=25))

    behind = run(True, "behind")
    assert [m for m, _ in seen] == list(range(1, 26))  # every result, in order
    assert all(name != main.name for _, name in seen)
    seen.clear()
    inline = run(False, "inline")
    assert all(name == main.name for _, name in seen)
    # The same proposals either way: the writes change when rows are stored, not the search.
    assert list(behind.results) == list(inline.results)
    if strategy == "forest":  # it proposes without Optuna: no study, nothing else to write
        assert optuna.get_all_study_summaries(storage=storage) == []
        return
    done = optuna.trial.TrialState.COMPLETE
    counts = [
        len(optuna.load_study(study_name=name, storage=storage).get_trials(states=(done,)))
        for name in ("behind", "inline")
    ]
    # TPE's trials hold its measurements and its invalid asks, told failed.
    assert counts[0] == counts[1] and counts[0] > 25


def test_a_failing_result_callback_fails_the_search_after_the_other_records():
    calls: list[int] = []

    def on_result(result, measured: int) -> None:
        calls.append(measured)
        if measured == 3:
            raise RuntimeError("database gone")

    search = Search(make_space(), Counter(), seed=1, on_result=on_result, write_behind=True)
    with pytest.raises(RuntimeError, match="database gone"):
        search.run(Budget(max_configs=20))
    # Raised by the release after the failed write's (one measurement later): every result
    # measured until then still got its callback, in order.
    assert len(search.results) == 4
    assert calls == list(range(1, len(search.results) + 1))


def test_writes_slower_than_the_measurements_hold_the_search_back_not_pile_up():
    """At most one batch outstanding: when a config starts measuring, every result but the
    last one has been recorded (a kill loses at most that one)."""
    recorded: list[int] = []
    lag: list[int] = []
    counter = Counter()

    def evaluate(config):
        lag.append(len(counter.calls) - len(recorded))  # measured, not yet recorded
        return counter(config)

    def on_result(result, measured: int) -> None:
        time.sleep(0.02)  # a slow database; measuring takes no time
        recorded.append(measured)

    Search(make_space(), evaluate, seed=2, on_result=on_result, write_behind=True).run(
        Budget(max_configs=20)
    )
    assert recorded == list(range(1, 21))
    assert max(lag) <= 1


class _Stop(Exception):
    """A stop signal raised from inside a measurement (the worker's budget-used, cancel)."""


def test_a_failed_write_outranks_a_stop_raised_by_the_measurement():
    """A job must not end as stopped (and then be finished) with a result it failed to store."""
    counter = Counter()

    def evaluate(config):
        if len(counter.calls) == 3:
            raise _Stop
        return counter(config)

    def on_result(result, measured: int) -> None:
        if measured == 3:
            raise RuntimeError("database gone")

    search = Search(make_space(), evaluate, seed=1, on_result=on_result, write_behind=True)
    with pytest.raises(RuntimeError, match="database gone") as raised:
        search.run(Budget(max_configs=20))
    assert isinstance(raised.value.__cause__, _Stop)


def test_a_failed_write_leaves_no_optuna_trial_running():
    def on_result(result, measured: int) -> None:
        if measured == 2:
            raise RuntimeError("database gone")

    search = Search(
        make_space(), Counter(), strategy="tpe", seed=1, on_result=on_result, write_behind=True
    )
    with pytest.raises(RuntimeError, match="database gone"):
        search.run(Budget(max_configs=20))
    running = search.study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert running == []


def test_an_evaluate_that_releases_the_writes_does_its_own_database_work_first():
    """``evaluate_releases`` (a worker: its reservation of the config before the earlier
    result's records, which would hold it up on SQLite's one writer): each result's write
    starts only once the next evaluate has done what comes before its release; an evaluate
    that never releases (another worker's result, awaited) has the writes started after it;
    every result is written, in order, at most one behind."""
    events: list[str] = []
    lock = threading.Lock()
    counter = Counter()
    search: Search | None = None

    def note(what: str) -> None:
        with lock:
            events.append(what)

    def evaluate(config):
        n = len(counter.calls) + 1
        note(f"reserve {n}")
        if n % 5 != 0:  # every fifth answers without a release of its own
            assert search is not None
            search.release_writes()
            search.release_writes()  # a second call in one trial is a no-op
        time.sleep(0.01)  # measuring: the released write runs meanwhile
        note(f"measured {n}")
        return counter(config)

    def on_result(result, measured: int) -> None:
        note(f"write {measured}")

    search = Search(
        make_space(), evaluate, seed=3, on_result=on_result, write_behind=True,
        evaluate_releases=True,
    )  # fmt: skip
    search.run(Budget(max_configs=20))
    writes = [int(e.split()[1]) for e in events if e.startswith("write")]
    assert writes == list(range(1, 21))
    at = events.index
    for n in range(2, 21):
        if n % 5 != 0:
            # The write of result n - 1 begins after trial n's reservation, never before it,
            # and is done before trial n + 1 measures: at most one result behind.
            assert at(f"reserve {n}") < at(f"write {n - 1}")
            assert n == 20 or at(f"write {n - 1}") < at(f"measured {n + 1}")
        else:  # released after trial n's evaluate, done before trial n + 1 measures
            assert at(f"measured {n}") < at(f"write {n - 1}")
            assert n == 20 or at(f"write {n - 1}") < at(f"measured {n + 1}")
