"""Who ``pvegpu reset`` signals, with what, and who it spares (and why): the one rule, pure.

``targets(facts, ...)`` is the core half of the rule: from one reading of the container's GPUs it names the
payload processes to signal (``term``: SIGTERM, then SIGKILL after the grace; ``kill_now``: SIGKILL at once) and
every other holder seen, with the reason it is spared. The dry run (``find.plan``) and the stop loop
(``stop.stop_and_verify``) both call it, so they cannot disagree. The adapter half is ``Host.signal``
(``adapters/procfs.py``): right before each signal it re-checks, through a pidfd, the process's identity (a
recycled pid is never hit), its placement (still in the target container) and that it is neither the
container's init nor pvegpu itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import Holder

STOPPED = "T"  # stopped by job control (SIGSTOP, Ctrl-Z): signals other than SIGKILL stay pending until SIGCONT
TRACED = "t"  # stopped by a tracer (a debugger): SIGCONT does not resume it, only the tracer or SIGKILL can
DEAD = ("Z", "X")  # exiting: nothing to signal


class Spared(StrEnum):
    """Why a holder seen on the container's GPUs is never signalled."""

    CT_INIT = "ct-init"  # the container's init: only a restart stops it
    SELF = "self"  # pvegpu itself
    EXITING = "exiting"  # a zombie or a dying task
    OUTSIDE = "outside"  # another container, a VM, the host, or a place that cannot be read

    def action(self, vmid: int) -> str:
        """What the dry run says it would do to such a holder."""
        return {Spared.CT_INIT: "none: container init; only a restart stops it", Spared.SELF: "none: pvegpu itself",
                Spared.EXITING: "none: it is exiting", Spared.OUTSIDE: f"none: outside CT {vmid}"}[self]


class KillNow(StrEnum):
    """Why a target gets SIGKILL at once instead of SIGTERM first."""

    TERM_FUTILE = "term-futile"  # SIGTERM ignored, traced by a debugger, or a nested namespace's init without a handler
    FROZEN = "frozen"  # its cgroup is frozen: SIGTERM would stay pending, SIGKILL kills frozen tasks


def kill_now_why(h: Holder) -> KillNow | None:
    """Why ``h`` gets SIGKILL at once (None: SIGTERM first). SIGTERM futility wins over a frozen cgroup."""
    if h.info.term_futile or h.info.state == TRACED:
        return KillNow.TERM_FUTILE
    if h.info.frozen:
        return KillNow.FROZEN
    return None


def spared_why(h: Holder, self_pid: int) -> Spared | None:
    """Why ``h``, a holder placed in the target container, is never signalled (None: it is a payload process)."""
    if h.info.is_ct_init:
        return Spared.CT_INIT
    if h.pid == self_pid:
        return Spared.SELF
    if h.info.state in DEAD:
        return Spared.EXITING
    return None


@dataclass(frozen=True)
class Targets:
    """One reading's decision: who gets which signal, and who is spared (each holder once per GPU it holds)."""

    term: list[Holder] = field(default_factory=list)  # SIGTERM (SIGCONT too when stopped), SIGKILL after the grace
    kill_now: list[Holder] = field(default_factory=list)  # SIGKILL at once (``kill_now_why``)
    spared: list[tuple[Holder, Spared]] = field(default_factory=list)  # never signalled, and why

    @property
    def signalled(self) -> list[Holder]:
        """Every target, by host pid."""
        return sorted(self.term + self.kill_now, key=lambda h: h.pid)

    def without(self, done: Iterable[object]) -> Targets:
        """The same decision minus targets whose identity is in ``done`` (already signalled in an earlier round)."""
        seen = set(done)
        return Targets([h for h in self.term if h.info.ident not in seen],
                       [h for h in self.kill_now if h.info.ident not in seen], self.spared)


def targets(facts: dict[int, GpuFacts], self_pid: int) -> Targets:
    """Decide, from one reading of the target container's GPUs (``holders.inspect_gpus``), who gets which signal and who is spared.

    Only payload processes of the container are targets: live holders placed in it that are neither its init nor
    pvegpu (``self_pid``). A process holding several of its GPUs is one target (its first holding, by host pid).
    Holders elsewhere are spared (``OUTSIDE``). ``Host.signal`` re-checks identity and placement before each signal.
    """
    chosen: dict[int, Holder] = {}
    spared: list[tuple[Holder, Spared]] = []
    for f in facts.values():
        for h in f.ct_holders:
            why = spared_why(h, self_pid)
            if why is None:
                chosen.setdefault(h.pid, h)
            else:
                spared.append((h, why))
        spared.extend((h, Spared.OUTSIDE) for h in f.other_holders)
    ordered = [h for _, h in sorted(chosen.items())]
    return Targets([h for h in ordered if kill_now_why(h) is None], [h for h in ordered if kill_now_why(h) is not None], spared)


def describe(h: Holder) -> dict[str, object]:
    """A holder as the report and the event log show it."""
    return {"pid": h.pid, "ns_pid": h.info.ns_pid, "comm": h.info.comm, "cgroup": h.info.cgroup,
            "state": h.info.state, "via": sorted(h.via)}


def planned_action(h: Holder) -> str:
    """What the stop loop will send this target (for --dry-run)."""
    why = kill_now_why(h)
    if why is KillNow.TERM_FUTILE:
        return "SIGKILL at once: SIGTERM cannot reach it (ignored, traced, or a nested namespace's init without a handler)"
    if why is KillNow.FROZEN:
        return "SIGKILL at once: its cgroup is frozen (SIGTERM would stay pending)"
    if h.info.state == STOPPED:
        return "SIGTERM, then SIGCONT (it is stopped), then SIGKILL after grace"
    return "SIGTERM, then SIGKILL after grace"
