"""What the phases of one reset return (typed results), and where the restart phase has taken the container."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pvegpu.core.holders import GpuFacts
from pvegpu.reset.vocab import CtState


class Verified(StrEnum):
    """What one verify phase found (compared with ``is``: as a str, ``Verified.CLEAN`` equals every other "clean")."""

    CLEAN = "clean"  # clean, and it held for ``settle``
    UNSETTLED = "unsettled"  # clean when the deadline came, but not yet for ``settle``
    NOT_CLEAN = "not clean"  # not clean when the deadline came
    HOLDERS = "holders"  # payload holders (re)appeared: signal them first


@dataclass
class CtTrack:
    """Where the restart phase has taken the CT so far. Kept as the phase goes (a signal may end the run at any
    step, and the interruption report needs it); the report copies it once, at the end."""

    stop_requested: bool = False  # this reset asked PVE to stop the CT (the critical section began)
    start_requested: bool = False  # ... and to start it again
    start_pending: bool = False  # that start failed to confirm, but its request may still run (its task, or no answer)
    ct_state: CtState | None = None  # the CT's last state read after a stop was requested (running/stopped/unknown)
    left_stopped: bool = False  # the CT is, or may end up, stopped because pvegpu asked for a stop
    restarted: bool = False
    pve_error: int | None = None  # exit code of a failed restart step


@dataclass(frozen=True)
class StopResult:
    """The stop phase: the last reading and its verdict (HOLDERS never leaves it)."""

    facts: dict[int, GpuFacts]
    verdict: Verified


@dataclass(frozen=True)
class RestartResult:
    """The restart phase: the last reading, and the verdict taken while the CT was stopped (None: no stop took
    effect, the stop phase's verdict stands)."""

    facts: dict[int, GpuFacts]
    verdict: Verified | None = None


@dataclass(frozen=True)
class Ended:
    """How the phases ended, for ``conclude``: the verdict (None: dry run, or ended before one) and the last facts
    (the whole host's when not clean)."""

    verdict: Verified | None
    facts: dict[int, GpuFacts] = field(default_factory=dict)
    dry_run: bool = False
