"""The one shape of every wait on a guest's state: read, judge, stop at the deadline, pause (pure, no dependencies).

``follow`` (a container, within the reset's deadline) and ``vmreset`` (a VM) both wait through ``until``; the waits
right after the signals (for the holders to go, for the memory to come back) pace their readings with ``Pace``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pvegpu.core.ports import Clock

R = TypeVar("R")
T = TypeVar("T")


def until(read: Callable[[], R], judge: Callable[[R], T | None], *, expired: Callable[[], bool], pause: Callable[[], None],
          on_wait: Callable[[], None] | None = None) -> tuple[T | None, R]:
    """Read until ``judge`` returns a decision (not None) or ``expired()`` says the deadline passed; the deadline is
    checked after every read, so a slow read cannot hide it. Returns the decision (None: the deadline came first)
    and the last reading. ``on_wait`` runs before each pause (progress for humans)."""
    while True:
        last = read()
        decided = judge(last)
        if decided is not None:
            return decided, last
        if expired():
            return None, last
        if on_wait is not None:
            on_wait()
        pause()


class Pace:
    """The pause before a wait's next reading. For the first ``fast_for`` seconds of the wait (the holders going and
    their memory coming back, due within ~0.1-0.2 s of the signal) it is ``fast``, then ``poll``; it is never shorter
    than the last reading took, so in the fast phase the readings take at most half of the time however costly one
    is (NVML plus a container's /proc: many processes, many ms), and never more often than ``poll`` once a reading
    costs that much. Each wait makes its own ``Pace``: every fast phase is bounded by its own ``fast_for``."""

    __slots__ = ("clock", "poll", "fast", "fast_until")

    def __init__(self, clock: Clock, poll: float, fast: float, fast_for: float) -> None:
        self.clock = clock
        self.poll = poll
        self.fast = min(fast, poll)
        self.fast_until = clock.monotonic() + max(0.0, fast_for)

    def after(self, cost: float) -> float:
        """The pause after a reading that took ``cost`` seconds."""
        if self.clock.monotonic() >= self.fast_until:
            return self.poll
        return min(self.poll, max(self.fast, cost))
