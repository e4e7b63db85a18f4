"""tuner.compile_slots: one process's nvcc slots handed out by urgency, and compile queues of
several jobs sharing them (tuner.compile_queue with ``slots``)."""

from __future__ import annotations

import threading
import time

from kato.tuner.compile_queue import CompileQueue
from kato.tuner.compile_slots import Abandoned, CompileSlots, Urgency, Want, wanting


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Holder:
    """A thread that holds a slot of ``slots`` with ``want`` until ``release`` is set."""

    def __init__(self, slots: CompileSlots, want: Want, name: str, order: list[str]):
        self.release = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                with slots.held(want):
                    order.append(name)
                    self.release.wait(10)
            except BaseException as error:  # noqa: BLE001 - the test reads it
                self.error = error

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()


def one_slot_held(urgency: Urgency, name: str) -> tuple[CompileSlots, list[str], Holder]:
    """A single slot (no reserve), held by a thread named ``name`` until its release is set;
    ``order`` lists the holders in the order they got the slot."""
    slots = CompileSlots(slots=1, reserved=0)
    order: list[str] = []
    holder = Holder(slots, Want(urgency), name, order)
    wait_until(lambda: order == [name])
    return slots, order, holder


def test_a_freed_slot_goes_to_the_most_urgent_waiter_the_earliest_of_equals():
    slots, order, first = one_slot_held(Urgency.BULK, "first")
    waiters = []
    for name, urgency in [("bulk", Urgency.BULK), ("next-1", Urgency.NEXT),
                          ("now", Urgency.NOW), ("next-2", Urgency.NEXT)]:  # fmt: skip
        waiters.append(Holder(slots, Want(urgency), name, order))
        count = len(waiters)
        wait_until(lambda: slots.counts()[2] == count)  # noqa: B023 - called at once
    for holder in [first, *waiters]:
        holder.release.set()
    for holder in [first, *waiters]:
        holder.thread.join(5)
    assert order == ["first", "now", "next-1", "next-2", "bulk"]
    assert slots.counts() == (0, 0, 0)


def test_speculative_compiles_leave_the_reserve_free_for_wanted_ones():
    slots = CompileSlots(slots=3, reserved=1)
    order: list[str] = []
    bulk = [Holder(slots, Want(Urgency.BULK), f"bulk-{i}", order) for i in range(3)]
    wait_until(lambda: slots.counts() == (2, 2, 1))  # the third bulk waits: reserve
    now = Holder(slots, Want(Urgency.NOW), "now", order)
    wait_until(lambda: "now" in order)  # the reserved slot, at once
    assert slots.counts() == (3, 2, 1)
    for holder in [*bulk, now]:
        holder.release.set()
    for holder in [*bulk, now]:
        holder.thread.join(5)
    assert sorted(order) == ["bulk-0", "bulk-1", "bulk-2", "now"]
    assert slots.counts() == (0, 0, 0)


def test_raising_a_waiting_want_puts_it_first_and_a_cancelled_one_gives_up():
    slots, order, first = one_slot_held(Urgency.NOW, "first")
    early, late, gone = Want(Urgency.NEXT), Want(Urgency.BULK), Want(Urgency.BULK)
    holders = [Holder(slots, early, "early", order), Holder(slots, late, "late", order)]
    wait_until(lambda: slots.counts()[2] == 2)
    cancelled = Holder(slots, gone, "gone", order)
    wait_until(lambda: slots.counts()[2] == 3)
    late.raise_to(Urgency.NOW)
    late.raise_to(Urgency.BULK)  # never lowered
    gone.cancel()
    cancelled.thread.join(5)
    assert isinstance(cancelled.error, Abandoned)
    for holder in [first, *holders]:
        holder.release.set()
    for holder in [first, *holders]:
        holder.thread.join(5)
    assert order == ["first", "late", "early"]
    assert late.urgency is Urgency.NOW


class SlotCompiler:
    """A compile function that, like nvcc.compile_kernel, holds one of ``slots`` (by the
    thread's want) while it runs; ``gate`` holds every compile until set."""

    def __init__(self, slots: CompileSlots):
        self.slots = slots
        self.gate = threading.Event()
        self.started: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, config):
        with self.slots.held():
            with self.lock:
                self.started.append(config["n"])
            assert self.gate.wait(10)
            return f"cubin-{config['n']}"


def test_a_jobs_wanted_compile_starts_before_another_jobs_speculative_ones():
    """Two jobs' queues on three slots, one reserved: job A's bulk fills the two others and
    queues more; job B's first compile (taken by its measurement) and its hint run before A's
    queued bulk, and a hint given to A while its threads wait is compiled before A's bulk."""
    slots = CompileSlots(slots=3, reserved=1)
    compiler = SlotCompiler(slots)
    a = CompileQueue(compiler, lambda c: c["n"], workers=4, slots=slots)
    b = CompileQueue(compiler, lambda c: c["n"], workers=4, slots=slots)
    try:
        a.add([{"n": f"a{i}"} for i in range(8)])
        wait_until(lambda: len(compiler.started) == 2)
        assert compiler.started == ["a0", "a1"]
        b.add([{"n": f"b{i}"} for i in range(8)])
        b.hint([{"n": "b5"}])
        wait_until(lambda: "b5" in compiler.started)  # the reserve: no bulk holds it
        a.hint([{"n": "a6"}])
        taken: list[str] = []
        taker = threading.Thread(target=lambda: taken.append(b.take({"n": "b7"})), daemon=True)
        waiting = slots.counts()[2]
        taker.start()  # b7 not started: compiled inline, NOW
        wait_until(lambda: slots.counts()[2] == waiting + 1)
        compiler.gate.set()
        taker.join(10)
        assert taken == ["cubin-b7"]
        wait_until(lambda: not a.pending() and not b.pending(), timeout=10)
        order = compiler.started
        assert order.index("b7") < order.index("a2")  # wanted now, before A's queued bulk
        assert order.index("a6") < min(order.index(f"a{i}") for i in (2, 3, 4, 5, 7))
        assert [a.take({"n": f"a{i}"}) for i in range(8)] == [f"cubin-a{i}" for i in range(8)]
    finally:
        compiler.gate.set()
        a.close()
        b.close()
    assert slots.counts() == (0, 0, 0)


def test_close_ends_threads_that_wait_for_a_slot():
    slots, order, blocker = one_slot_held(Urgency.NOW, "blocker")
    queue = CompileQueue(lambda c: c["n"], lambda c: str(c["n"]), workers=2, slots=slots)
    queue.add([{"n": i} for i in range(5)])
    wait_until(lambda: slots.counts()[2] == 2)
    started = time.monotonic()
    queue.close()  # does not wait for the blocker's slot
    assert time.monotonic() - started < 2
    assert slots.counts() == (1, 0, 0) and queue.pending() == 0
    blocker.release.set()
    blocker.thread.join(5)


def test_a_thread_compiles_under_the_want_it_is_given():
    seen: list[Urgency] = []

    def compile_fn(_config):
        from kato.tuner.compile_slots import current_want

        seen.append(current_want().urgency)
        return "ok"

    assert compile_fn({}) == "ok"  # a caller's own thread: it waits, NOW
    with wanting(Want(Urgency.BULK)):
        compile_fn({})
    assert seen == [Urgency.NOW, Urgency.BULK]


def test_a_thread_handed_a_slot_gives_it_back_to_follow_another_callers_compile(monkeypatch):
    """A queue's thread holds the only slot and follows another caller's compile of the same
    source, which waits for a slot: the follower gives its slot back (no deadlock)."""
    from kato.tuner import nvcc as nvcc_module

    slots = CompileSlots(slots=1, reserved=0)
    in_compile, registered = threading.Event(), threading.Event()
    done: list[str] = []

    def compile_fn(_config):
        in_compile.set()
        assert registered.wait(5)
        with nvcc_module._IN_FLIGHT.leader("review-follow") as leads:
            assert not leads
        return "followed"

    def lead() -> None:
        with nvcc_module._IN_FLIGHT.leader("review-follow") as leads:
            assert leads
            registered.set()
            with slots.held():
                done.append("led")

    queue = CompileQueue(compile_fn, lambda c: c["n"], workers=1, slots=slots)
    try:
        queue.add([{"n": "x"}])
        assert in_compile.wait(5)
        leader = threading.Thread(target=lead, daemon=True)
        leader.start()
        leader.join(5)
        assert done == ["led"]
        assert queue.take({"n": "x"}) == "followed"
    finally:
        registered.set()
        queue.close()
    assert slots.counts() == (0, 0, 0)


def test_a_config_a_measurement_waits_for_is_picked_first_at_now():
    """wait_any on a config still queued puts it at the front at NOW: the queue's waiting
    thread then goes before another queue's hint and picks it."""
    slots, order, blocker = one_slot_held(Urgency.NOW, "blocker")
    compiler = SlotCompiler(slots)
    compiler.gate.set()
    queue = CompileQueue(compiler, lambda c: c["n"], workers=1, slots=slots)
    try:
        queue.add([{"n": n} for n in ("q1", "q2", "q3")])
        wait_until(lambda: slots.counts()[2] == 1)  # its thread waits for the slot, BULK
        hinted = Holder(slots, Want(Urgency.NEXT), "other-job-hint", order)
        wait_until(lambda: slots.counts()[2] == 2)
        assert queue.wait_any([{"n": "q3"}]) is False  # not started: no wait
        blocker.release.set()
        wait_until(lambda: "q3" in compiler.started)
        hinted.release.set()
        hinted.thread.join(5)
        assert compiler.started[0] == "q3" and order[1] == "other-job-hint"
        wait_until(lambda: not queue.pending())
    finally:
        queue.close()
        blocker.release.set()
        blocker.thread.join(5)
