"""pvegpu's own threads (adapters/workers.py): a join with a deadline, and no fork while one of them is at work."""

from __future__ import annotations

import _thread

from pvegpu.adapters import scanpool, workers
from pvegpu.adapters.workers import Worker


def test_join_waits_at_most_its_timeout_and_then_sees_the_return():
    """A worker blocked in its call: join(timeout) is False and it is alive; once the call returns, join is True."""
    gate = _thread.allocate_lock()
    gate.acquire()
    w = Worker(gate.acquire)
    assert w.join(0.05) is False and w.alive
    gate.release()
    assert w.join(5) is True and not w.alive and w.join(0) is True


def test_a_working_worker_keeps_the_process_from_forking():
    """While a worker runs, running() is true and scanpool.forkable() says no; after it returns, it says yes again."""
    gate = _thread.allocate_lock()
    gate.acquire()
    before = scanpool.forkable()
    w = Worker(gate.acquire)
    assert workers.running() and not scanpool.forkable()
    gate.release()
    assert w.join(5)
    assert scanpool.forkable() == before


def test_a_call_that_raises_still_ends_its_worker_and_keeps_the_error():
    """A call that raises (a bug in it) still ends the worker: join returns, and the error is kept for the caller."""
    def boom() -> None:
        raise ValueError("boom")

    w = Worker(boom)
    assert w.join(5) and not w.alive and isinstance(w.error, ValueError) and w.value is None


def test_the_value_is_kept():
    """What the call returned is the worker's value once it has returned."""
    w = Worker(lambda: 42)
    assert w.join(5) and w.value == 42 and w.error is None
