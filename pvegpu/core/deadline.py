"""The one deadline type: a point in a ``Clock``'s time (the port, so tests run on a fake clock).

Every wait of the core ends by one (reset's phases, each within the run's overall deadline; the VM reset's
waits). Adapters that cannot take the Clock port (a forked child, a subprocess's pipes) use ``time.monotonic``
themselves; the core never does (``tests/test_structure.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pvegpu.core.ports import Clock


@dataclass(frozen=True)
class Deadline:
    """A point in ``clock`` time. Loops check it after each read, so a slow read cannot hide it."""

    clock: Clock
    at: float
    label: Callable[[], str] | None = None  # what is awaited, for progress (a watched deadline: ``ResetRun.watched``)
    on_wait: Callable[[str, float, Deadline], None] | None = None
    since: float = 0.0
    hopeless: Callable[[], bool] | None = None  # a watched deadline ends early when waiting cannot help (a GPU lost)

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock.monotonic())

    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at or (self.hopeless is not None and self.hopeless())

    def fits(self, seconds: float) -> bool:
        """Whether something that takes ``seconds``, started now, ends by this deadline (a look inside a VM)."""
        return self.clock.monotonic() + max(0.0, seconds) <= self.at

    def within(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, never later than this one."""
        return Deadline(self.clock, min(self.at, self.clock.monotonic() + max(0.0, seconds)))

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or until the deadline if that comes first (a watched deadline says what it waits for)."""
        if self.label is not None and self.on_wait is not None:
            self.on_wait(self.label(), self.since, self)
        self.clock.sleep(min(seconds, self.remaining()))


def deadline_in(clock: Clock, seconds: float) -> Deadline:
    """A deadline ``seconds`` from now on ``clock``."""
    return Deadline(clock, clock.monotonic() + max(0.0, seconds))
