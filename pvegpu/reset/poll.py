"""The one shape of every wait on a guest's state: read, judge, stop at the deadline, pause (pure, no dependencies).

``follow`` (a container, within the reset's deadline) and ``vmreset`` (a VM) both wait through ``until``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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
