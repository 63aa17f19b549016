"""The values of ``pvegpu reset``: its policy, its outcome, its report, and the ports it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.core.leftover import DEFAULT_THRESHOLD_MIB, LeftoverRule
from pvegpu.core.model import MIB, Step
from pvegpu.core.ports import Clock, EventLog, GpuProbe, Host, Interrupts, KernelLog, LockPort, NoInterrupts, NullLockPort, NullLog, PveApi
from pvegpu.core.settings import ResetSettings
from pvegpu.reset.vocab import Diagnosis, Respawn

_D = ResetSettings()  # the one source of defaults


@dataclass(frozen=True)
class ResetPolicy:
    """How hard and how long ``pvegpu reset`` tries (``[reset]`` in the settings, ``--timeout``/``--grace``).
    ``wiring.reset_policy`` derives it from the settings; its defaults are the settings' defaults."""

    grace: float = _D.grace  # seconds between SIGTERM and SIGKILL
    kill_wait: float = _D.kill_wait  # seconds to wait for SIGKILLed processes to go
    timeout: float = _D.timeout  # seconds to wait for the memory after the last signal / the stop
    poll: float = _D.poll  # seconds between readings
    fast_poll: float = 0.005  # seconds between readings right after the signals (``poll.Pace``), at most ``poll``
    fast_for: float = 0.5  # seconds of each wait after the signals that reads every ``fast_poll`` (while readings are cheap)
    exit_poll: float = 0.001  # seconds between looks at signalled holders (one /proc stat read each) in that phase
    settle: float = _D.settle  # clean must hold this long (a respawning unit restarts within ~0.1 s)
    rounds: int = _D.rounds  # signal rounds against respawning holders
    threshold_bytes: int = DEFAULT_THRESHOLD_MIB * MIB  # leftover.threshold_mib: net leftover still counted as clean
    per_context_bytes: int = LeftoverRule().per_context_bytes  # leftover.per_context_mib: allowance per outside context
    restart: bool = _D.restart
    dry_run: bool = False
    task_timeout: float = _D.task_timeout  # seconds for each PVE stop/start task (and for HA to act on it)
    state_wait: float = 15.0  # seconds to poll the CT's state after a failed stop/start to learn where it is
    start_settle: float = 1.0  # a started CT must still be running this long after its start task said OK

    @property
    def rule(self) -> LeftoverRule:
        return LeftoverRule(self.threshold_bytes, self.per_context_bytes)

    @property
    def budget(self) -> float:
        """The overall deadline of one reset, in seconds: every phase's own bound, added up."""
        reclaim = self.rounds * (self.grace + self.kill_wait) + (self.rounds + 1) * self.timeout
        restart = 4 * self.task_timeout + 2 * self.state_wait + self.start_settle + self.timeout if self.restart else 0.0
        return reclaim + restart


class ResetOutcome(StrEnum):
    """The verdict of a reset, as the CLI, the JSON and the hook show it: its value (and ``label``) are the words
    the JSON's ``outcome`` has always carried; ``slug`` is the closed name (the JSON's ``outcome_kind``)."""

    CLEAN = "clean"  # verified: no holder, memory back, held for ``settle``
    CLEAN_RESTART_FAILED = "clean, but the restart failed"  # verified while stopped; the start (or the stop's bookkeeping) failed
    NOT_VERIFIED = "not verified"  # clean at the deadline, but not for ``settle`` (or never read)
    NOT_CLEAN = "not clean"
    DRY_RUN = "dry-run"

    @property
    def verified_clean(self) -> bool:
        return self in (ResetOutcome.CLEAN, ResetOutcome.CLEAN_RESTART_FAILED)

    @property
    def slug(self) -> str:
        """The outcome for programs ("clean-restart-failed"); the value stays the words the JSON has always had."""
        return self.name.lower().replace("_", "-")

    @property
    def label(self) -> str:
        """The outcome for humans ("clean, but the restart failed")."""
        return self.value


@dataclass
class ResetReport:
    vmid: int
    node: str = ""
    gpus: list[int] = field(default_factory=list)  # minors
    before: dict[int, GpuFacts] = field(default_factory=dict)
    after: dict[int, GpuFacts] = field(default_factory=dict)
    clean: dict[int, bool] = field(default_factory=dict)  # per GPU minor: the target's own memory is gone (verify.is_clean), at the end
    steps: list[Step] = field(default_factory=list)
    signalled: list[dict[str, object]] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)  # --dry-run
    outcome: ResetOutcome = ResetOutcome.NOT_CLEAN
    exit_code: int = E.EXIT_FAILURE
    diagnosis: list[Diagnosis] = field(default_factory=list)  # kind, problem, what to do (unpacks as the pair)
    notes: list[str] = field(default_factory=list)
    restarted: bool = False
    pve_error: int | None = None  # exit code of a failed restart step
    left_stopped: bool = False  # the CT is, or may end up, stopped because pvegpu asked for a stop
    ct_state: str | None = None  # the CT's last state read after a stop was requested (running/stopped/unknown)
    task_log: list[str] = field(default_factory=list)  # the last lines of a failed or timed-out PVE task's log
    respawns: list[Respawn] = field(default_factory=list)  # holders that appeared after a round, with their parent
    interrupted: dict[str, object] | None = None  # a signal during the reset: its name, what pvegpu did, where the CT is
    stop_requested: bool = False  # this reset asked PVE to stop the CT (the critical section began)
    start_requested: bool = False  # ... and to start it again
    app_container: str | None = None  # why its reset is its verified restart (``appct.app_reason``); None: signal rounds
    elapsed: float = 0.0


@dataclass
class Ports:
    pve: PveApi
    probe: GpuProbe
    host: Host
    clock: Clock
    log: EventLog = field(default_factory=NullLog)
    lock: LockPort = field(default_factory=NullLockPort)  # the reset's own lock of the container (marks for the gate)
    interrupts: Interrupts = field(default_factory=NoInterrupts)  # signals: the critical section from the stop request on
    kernlog: KernelLog | None = None  # the kernel log's Xids: the diagnosis of a holder stuck in the driver (None: not read)
