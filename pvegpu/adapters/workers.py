"""pvegpu's own background threads: NVML's warm-up (``nvml_warm``) and the bounded reads' workers (``bounded``).

Started through the built-in ``_thread``, not ``threading`` (its import, with ``functools`` and ``collections``, is
~3 ms of a reset's and an audit's start-up before their first reading). A ``Worker`` runs one call; ``join(timeout)``
waits for it at most that long (a lock acquired with a timeout, as ``threading.Thread.join`` does it); ``alive`` says
whether it has returned. ``running()``: one of them is still at work in this process, so the process must not fork
(``scanpool.forkable``: a fork copies only the calling thread, and with it a lock or a driver call mid-way).
A worker's thread is never joined at exit: pvegpu ends with ``os._exit``, and a worker stuck in the driver cannot be
stopped anyway.
"""

from __future__ import annotations

import _thread
import os

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from collections.abc import Callable

_running = [0]  # workers started and not returned (``running``)


def running() -> bool:
    """One of pvegpu's workers is still at work in this process."""
    return _running[0] > 0


def _forked() -> None:
    """In a forked child only the forking thread lives on: no worker is at work there (a worker object the child
    inherited still says it is alive, and a read behind it answers unknown: the safe side)."""
    _running[0] = 0


os.register_at_fork(after_in_child=_forked)


class Worker:
    """``fn()`` called once in a thread of its own, started now: ``value`` is what it returned, ``error`` what it
    raised (kept for the caller to raise in its own thread; never printed from this one)."""

    __slots__ = ("_done", "_returned", "error", "value")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.value: object = None
        self.error: BaseException | None = None
        self._returned = False  # ``alive`` reads this, not the lock: a join holds the lock for an instant
        done = self._done = _thread.allocate_lock()
        done.acquire()

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                self.error = exc
            finally:
                self._returned = True
                _running[0] -= 1
                done.release()  # the thread's last step

        _running[0] += 1
        try:
            _thread.start_new_thread(run, ())
        except BaseException:
            _running[0] -= 1
            done.release()
            raise

    @property
    def alive(self) -> bool:
        """``fn`` has not returned yet."""
        return not self._returned

    def join(self, timeout: float | None = None) -> bool:
        """Wait until ``fn`` has returned, at most ``timeout`` seconds (None: no limit); True once it has."""
        if self._done.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._done.release()
            return True
        return False
