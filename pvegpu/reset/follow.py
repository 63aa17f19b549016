"""Following a container's state until a deadline: the one loop every restart wait uses.

``follow`` (through ``poll.until``, the shape every guest-state wait shares) reads the CT's status (a failed read is a reading too, never a crash), asks ``judge`` whether what it
sees settles the wait, and otherwise says what it waits for and pauses, until ``judge`` decides or the deadline
passes. The deadline is checked after every read, so a slow read cannot hide it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pvegpu.core import errors as E
from pvegpu.core.model import CtStatus
from pvegpu.reset.poll import until
from pvegpu.reset.run import ResetRun
from pvegpu.reset.vocab import CtState

T = TypeVar("T")


@dataclass(frozen=True)
class Reading:
    """One read of ``status/current``: the status (None: the read failed, ``error`` says why) and when it ended."""

    status: CtStatus | None
    error: str
    at: float

    @property
    def state(self) -> CtState:
        """running or stopped as PVE says; unknown when the read failed (or PVE said something else)."""
        return CtState.parse(self.status.status) if self.status is not None else CtState.UNKNOWN


def read(run: ResetRun) -> Reading:
    try:
        st, error = run.p.pve.ct_status(run.guest), ""
    except E.PvegpuError as exc:
        st, error = None, exc.message
    return Reading(st, error, run.clock.monotonic())


def follow(run: ResetRun, judge: Callable[[Reading], T | None], *, within: float, poll: float, waiting: str,
           skip_if_expired: bool = False) -> tuple[T | None, Reading | None]:
    """Read until ``judge`` returns a decision (not None), or ``within`` seconds (never past the reset's deadline)
    have passed: returns the decision (None: the deadline passed first) and the last reading (None: none was made,
    ``skip_if_expired`` and no time was left). ``judge`` may raise to end the wait with an error."""
    deadline = run.deadline.within(within)
    t0 = run.clock.monotonic()
    if skip_if_expired and deadline.expired():
        return None, None
    return until(lambda: read(run), judge, expired=deadline.expired, pause=lambda: deadline.pause(poll),
                 on_wait=lambda: run.progress(waiting, t0, deadline))
