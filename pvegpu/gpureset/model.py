"""The values of ``pvegpu gpu-reset``: its policy, the plan, the report and the ports it runs on."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum

from pvegpu.core import errors as E
from pvegpu.core.model import MIB, GpuHealth, GpuInfo, Step
from pvegpu.core.ports import (
    Clock,
    EventLog,
    GpuControl,
    GpuProbe,
    Host,
    Interrupts,
    KernelLog,
    LockPort,
    NodeFiles,
    NoInterrupts,
    NullLog,
    PveApi,
)
from pvegpu.core.settings import GpuResetSettings
from pvegpu.reset.report import ResetPolicy
from pvegpu.reset.vocab import Diagnosis

_D = GpuResetSettings()


class Outcome(StrEnum):
    """The verdict of one gpu-reset (the JSON's ``outcome``)."""

    DRY_RUN = "dry-run"
    RESET = "reset"  # reset, and NVML says it is back: answers, idle memory, recovery action none
    UNVERIFIED = "unverified"  # reset; it answers at idle memory, but NVML cannot tell its recovery action
    NOT_BACK = "not-back"  # reset ran, but NVML says the GPU is not back
    FAILED = "failed"  # the reset failed or timed out
    REFUSED = "refused"  # it cannot work as things are (who blocks is named); nothing was reset


class Refusal(StrEnum):
    """Why a gpu-reset cannot work (each a ``Diagnosis`` kind in the report's ``refusals``)."""

    VM_PASSTHROUGH = "vm-passthrough"  # a VM has the GPU: the host driver does not own it
    CLIENT = "client"  # a process that will not let go of the GPU
    NVLINK = "nvlink"  # active NVLinks: the peers are reset together (whole node)
    FABRIC_MANAGER = "fabric-manager"  # NVSwitch system: Fabric Manager resets the partition or the node
    REBOOT = "reboot"  # NVML says the GPU needs a reboot, not a reset
    NO_RESET = "no-reset"  # the driver has no reset for this GPU
    CT_BUSY = "ct-busy"  # a pvegpu reset of one of its containers is running

    @property
    def info(self) -> bool:
        return False


@dataclass(frozen=True)
class GpuResetPolicy:
    """``[gpureset]`` and the reset's stop/start waits (``wiring.gpu_reset_policy``)."""

    restart: ResetPolicy = ResetPolicy()  # the API stop/start: task_timeout, state_wait, start_settle
    idle_bytes: int = _D.idle_mib * MIB  # used memory at most this after the reset is the idle baseline
    client_wait: float = _D.client_wait  # host clients get this long to let go once persistence mode is off
    verify_wait: float = 30.0  # the GPU gets this long to answer at its idle baseline after the reset
    poll: float = 0.2
    dry_run: bool = False


@dataclass(frozen=True)
class GuestPlan:
    vmid: int
    type: str  # lxc | qemu
    name: str
    status: str  # running | stopped | unknown (a VM: the driver bound to the GPU, e.g. "bound to vfio-pci")
    action: str
    ha_managed: bool = False


@dataclass(frozen=True)
class ClientPlan:
    pid: int
    comm: str
    where: str  # host | CT N | VM N | unknown
    via: tuple[str, ...]
    action: str


@dataclass
class GpuResetReport:
    gpu: GpuInfo
    node: str = ""
    guests: list[GuestPlan] = field(default_factory=list)
    clients: list[ClientPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    refusals: list[Diagnosis] = field(default_factory=list)
    health: GpuHealth | None = None
    used_before: int | None = None
    persistence_before: bool | None = None
    steps: list[Step] = field(default_factory=list)
    diagnosis: list[Diagnosis] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # CTs this run stopped
    restarted: list[int] = field(default_factory=list)  # ... and started again, verified running
    left_stopped: list[int] = field(default_factory=list)  # ... that are (or may be) stopped now
    reset_ran: bool = False
    used_after: int | None = None
    recovery_after: str | None = None
    outcome: Outcome = Outcome.FAILED
    exit_code: int = E.EXIT_FAILURE
    interrupted: dict[str, object] | None = None
    elapsed: float = 0.0

    @property
    def label(self) -> str:
        return f"GPU {self.gpu.index} ({self.gpu.uuid}, {self.gpu.bus_id})"


@dataclass
class GpuResetPorts:
    """What gpu-reset acts through.

    ``ct_lock(vmid, on_wait)``: the reset lock of a container it stops (a ``LockPort`` while held; ``on_wait`` is told
    what it waits for). ``gate(vmid, waive_health)``: the start gate's verdict (allow, its paragraph), with
    ``gate.health = warn`` when ``waive_health``. ``allow_once(vmid)``: the token that lets the container's next start
    past the hookscript's gate, returning the call that removes that token again (a start that failed before the
    hookscript took it). ``release_nvml()``: pvegpu's own NVML handle closed (a resident client blocks the reset; the
    next reading opens it again)."""

    pve: PveApi
    probe: GpuProbe
    host: Host
    clock: Clock
    control: GpuControl
    files: NodeFiles | None = None
    ct_lock: Callable[[int, Callable[[str], None]], AbstractContextManager[LockPort]] | None = None  # (vmid, what to say while it waits)
    gate: Callable[[int, bool], tuple[bool, str]] | None = None
    release_nvml: Callable[[], None] = lambda: None
    undrain: Callable[[], None] = lambda: None  # the draining mark lifted: starts onto the GPU are judged as any start again
    allow_once: Callable[[int], Callable[[], object]] | None = None  # writes the token; the call returned withdraws exactly it
    kernlog: KernelLog | None = None  # where a verified reset is recorded: it ends the GPU's Xids for the gate (pvegpu.health)
    log: EventLog = field(default_factory=NullLog)
    interrupts: Interrupts = field(default_factory=NoInterrupts)
    on_step: Callable[[Step], None] | None = None
