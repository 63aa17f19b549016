"""The verdict of one reset and its exit code: the only exit-code table of ``pvegpu reset``."""

from __future__ import annotations

from dataclasses import dataclass

from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.reset.report import ResetOutcome
from pvegpu.reset.results import Verified


@dataclass(frozen=True)
class Conclusion:
    outcome: ResetOutcome
    exit_code: int


def gpu_exit(facts: dict[int, GpuFacts]) -> int:
    """The exit code for a GPU that is not clean: unknown (5), holders left (6), memory left (7)."""
    if any(not f.sample.known for f in facts.values()):
        return E.EXIT_GPU_UNKNOWN
    if any(f.ct_holders or f.unreadable for f in facts.values()):
        return E.EXIT_HOLDERS_LEFT
    return E.EXIT_MEMORY_LEFT


def conclude(verdict: Verified | None, facts: dict[int, GpuFacts], *, dry_run: bool = False, pve_error: int | None = None,
             left_stopped: bool = False, signal_exit: int | None = None) -> Conclusion:
    """Outcome and exit code (README "Exit codes"), from what the phases returned:

    ============================================  ==============================  =================================
    dry run                                       dry-run                         0
    clean, no restart step failed, not stopped    clean                           0
    clean, a restart step failed or left stopped  clean, but the restart failed   that step's code, else 4
    clean at the deadline, not for settle         not verified                    a failed restart step's, else 5
    not clean                                     not clean                       a failed restart step's, else 5/6/7
    ended before a verdict                        not clean                       1
    a signal after the stop request               (any of the above)              128+n
    ============================================  ==============================  =================================
    """
    if dry_run:
        c = Conclusion(ResetOutcome.DRY_RUN, E.EXIT_OK)
    elif verdict is Verified.CLEAN:
        ok = pve_error is None and not left_stopped
        c = Conclusion(ResetOutcome.CLEAN, E.EXIT_OK) if ok else Conclusion(ResetOutcome.CLEAN_RESTART_FAILED, pve_error or E.EXIT_PVE)
    elif verdict is Verified.UNSETTLED:
        c = Conclusion(ResetOutcome.NOT_VERIFIED, pve_error or E.EXIT_GPU_UNKNOWN)
    elif verdict is None:
        c = Conclusion(ResetOutcome.NOT_CLEAN, E.EXIT_FAILURE)
    else:
        c = Conclusion(ResetOutcome.NOT_CLEAN, pve_error or gpu_exit(facts))
    return c if signal_exit is None else Conclusion(c.outcome, signal_exit)
