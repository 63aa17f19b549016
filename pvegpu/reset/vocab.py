"""The reset's closed vocabularies: what a diagnosis is about (``Kind``), the diagnosis itself, step names and
the outcomes steps report. Tests assert these; the wording is the humans' (tested once per kind)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """What one diagnosis line is about."""

    GPU_UNREADABLE = "gpu-unreadable"  # NVML could not read a GPU
    STUCK_IN_DRIVER = "stuck-in-driver"  # a holder in state D
    INIT_HOLDS = "init-holds"  # the container's init holds the GPU (never signalled)
    HOLDER_LEFT = "holder-left"  # a payload holder is still there
    FDS_UNREADABLE = "fds-unreadable"  # a container pid whose open files could not be read
    NEIGHBOUR = "neighbour"  # another workload uses the GPU too (information: never touched, nothing to do)
    TARGET_GHOST = "target-ghost"  # a dead pid of the target still listed: its context lives on
    DRIVER_LEAK = "driver-leak"  # the target's memory left with no live holder
    UNMEASURABLE = "unmeasurable"  # other processes' memory not reported (MIG?)
    UNEXPLAINED_GHOST = "unexplained-ghost"  # a dead listed pid that was never the target's, no heir
    FOREIGN_GHOST = "foreign-ghost"  # a dead listed pid that was alive outside the target at the first reading
    FOREIGN_LEFTOVER = "foreign-leftover"  # memory left before the reset, not the target's
    RESPAWNED = "respawned"  # a supervisor restarted holders after they were stopped
    TIMEOUT_TOO_SHORT = "timeout-too-short"  # --timeout not longer than the settle window
    UNSETTLED = "unsettled"  # the memory came back too late to hold for the settle window
    HELD_STOPPED = "held-stopped"  # left stopped: not clean even while stopped
    LEFT_STOPPED = "left-stopped"  # a failed stop/start left the CT stopped
    MAY_STOP = "may-stop"  # still running, but a stop may still take effect
    STATE_UNKNOWN = "state-unknown"  # its state could not be read after the stop request
    RESTART_FAILED = "restart-failed"  # a restart step failed (the error and its hint)
    TASK_LOG = "task-log"  # the failed task's log tail
    EARLIER_STOP = "earlier-stop"  # an earlier reset asked for the stop and ended before the CT ran again
    INTERRUPTED = "interrupted"  # a signal after the stop request

    @property
    def info(self) -> bool:
        """Information, not a problem: nothing to do about it here."""
        return self is Kind.NEIGHBOUR


@dataclass(frozen=True)
class Diagnosis:
    """One line of a reset's diagnosis: its kind, the problem (or, for information, the fact) and what to do.
    Unpacks as ``(problem, action)``, as the pairs it replaces did."""

    kind: Kind
    problem: str
    action: str = ""

    def __iter__(self) -> Iterator[str]:
        return iter((self.problem, self.action))

    @property
    def info(self) -> bool:
        return self.kind.info


class CtState(StrEnum):
    """A container's state as the reset follows it (PVE's ``status/current``; unknown when it cannot be read)."""

    RUNNING = "running"
    STOPPED = "stopped"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, status: str) -> CtState:
        """PVE's word for an LXC container's state; anything else (or nothing) is unknown, never running."""
        try:
            return cls(status)
        except ValueError:
            return cls.UNKNOWN


class StepName(StrEnum):
    """The steps a container reset reports (``ResetReport.steps``, the event log, the live output)."""

    LOCATE = "locate"
    DRY_RUN = "dry-run"
    ROUND = "round"
    SIGNAL = "signal"
    SURVIVOR = "survivor"
    RESPAWN = "respawn"
    DEADLINE = "deadline"
    VERIFY = "verify"
    RESTART = "restart"
    TASK = "task"
    STATE = "state"  # its outcome is a CtState
    EARLIER = "earlier"  # its outcome is a CtState
    INTERRUPTED = "interrupted"  # its outcome is the signal's name


class StepOutcome(StrEnum):
    """What a step reports (besides a signal's ``SignalResult``, a ``CtState`` and a signal's name)."""

    OK = "ok"
    START = "start"
    STOP = "stop"
    SKIPPED = "skipped"
    CONTINUE = "continue"
    FAILED = "failed"
    SEEN = "seen"
    CLEAN = "clean"
    UNSETTLED = "unsettled"
    TIMEOUT = "timeout"
    UNREADABLE = "unreadable"
    HELD = "held"
    LEFT_STOPPED = "left stopped"


@dataclass(frozen=True)
class Respawn:
    """A holder that appeared after a signal round, with the parent that started it."""

    pid: int
    ns_pid: int | None
    comm: str
    after_round: int
    parent_pid: int | None
    parent_comm: str | None
    parent_is_ct_init: bool
    by: str  # who started it, for humans ("the container's init (pid 1234, systemd)")

    def as_json(self) -> dict[str, object]:
        return {"pid": self.pid, "ns_pid": self.ns_pid, "comm": self.comm, "after_round": self.after_round,
                "parent_pid": self.parent_pid, "parent_comm": self.parent_comm, "parent_is_ct_init": self.parent_is_ct_init,
                "by": self.by}
