"""Plain values shared by the core, the adapters and the renderers (no I/O here)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import StrEnum

MIB = 1024 * 1024
CONTROL = -1  # pseudo-minor: nvidiactl, nvidia-modeset, nvidia-uvm(-tools), nvidia-caps (no particular GPU)


@dataclass(frozen=True)
class Guest:
    """Where a guest lives: ``pvesh get /cluster/resources --type vm`` (one row)."""

    vmid: int
    node: str
    type: str  # "lxc" or "qemu"
    name: str = ""


@dataclass(frozen=True)
class CtStatus:
    """``pvesh get /nodes/<node>/lxc/<vmid>/status/current`` reduced to what reset needs."""

    status: str  # running | stopped | unknown
    ha_managed: bool = False
    lock: str | None = None
    ha_state: str | None = None  # HA's state of the resource when managed (started, stopped, error, fence, ...)


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML names it (``nvidia-smi -L``); ``minor`` is N of /dev/nvidiaN."""

    index: int
    minor: int
    uuid: str
    bus_id: str
    name: str = ""
    total_bytes: int | None = None


@dataclass(frozen=True)
class GpuHealth:
    """Health and memory split of one GPU (``nvidia-smi -q -d MEMORY,ROW_REMAPPER,PAGE_RETIREMENT`` + MIG mode).

    Every field is None where NVML cannot tell (NotSupported, an error): unknown, never zero or False.
    """

    reserved_bytes: int | None = None  # memory v2 ``reserved`` (driver/firmware share)
    retired_pages_pending: bool | None = None  # pre-Ampere page retirement waiting for a reset
    remap_pending: bool | None = None  # Ampere+ row remapping waiting for a reset
    remap_failed: bool | None = None  # a row remapping failed (GPU should be serviced)
    mig_enabled: bool | None = None  # MIG mode (current)
    driver_version: str | None = None
    recovery_action: str | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION by name (RECOVERY_ACTIONS); None: not read
    ecc_volatile_uncorrected: int | None = None  # uncorrected ECC errors since the driver loaded (volatile)
    persistence_mode: bool | None = None
    lost: bool | None = None  # NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus (Xid 79)


# NVML_GPU_RECOVERY_ACTION_* by value (nvml.h), as pvegpu names them; a value not listed is read as "unknown-N"
RECOVERY_ACTIONS = {0: "none", 1: "gpu-reset", 2: "node-reboot", 3: "drain-p2p", 4: "drain-and-reset",
                    5: "recover-imex-domain", 6: "bus-reset", 7: "system-reboot"}


@dataclass(frozen=True)
class NvmlProcess:
    """A PID NVML lists on a GPU (host PID); ``used_bytes`` None = not available (MIG)."""

    pid: int
    used_bytes: int | None
    kind: str = "C"  # C compute, G graphics, M MPS


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU: memory v2 ``used`` and the process lists.

    ``used_bytes``/``processes`` are None when the reading could not be made; ``error`` says why.
    Unknown is never zero.
    """

    minor: int
    used_bytes: int | None
    processes: tuple[NvmlProcess, ...] | None
    error: str | None = None

    @property
    def known(self) -> bool:
        return self.used_bytes is not None and self.processes is not None


class Place(StrEnum):
    """Where a host process sits, from ``/proc/<pid>/cgroup``."""

    CONTAINER = "container"  # /lxc/<vmid>/...
    MONITOR = "monitor"  # /lxc.monitor/<vmid>: the lxc-start monitor, never touched
    VM = "vm"  # /qemu.slice/<vmid>.scope
    HOST = "host"  # anything else
    UNKNOWN = "unknown"  # /proc/<pid>/cgroup unreadable or self-contradicting: never "host", never "clean"


@dataclass(frozen=True)
class Placement:
    place: Place
    vmid: int | None = None


SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP", signal.SIGKILL: "SIGKILL",
                signal.SIGCONT: "SIGCONT"}  # the signals pvegpu sends (a reset) and handles (Ctrl-C, kill, a dropped session)


class SignalResult(StrEnum):
    """What ``Host.signal`` did: a str enum, so JSON and logs show the plain word."""

    SENT = "sent"  # delivered through the pidfd
    GONE = "gone"  # exited, or the pid was recycled
    MOVED = "moved"  # no longer in the target container
    REFUSED = "refused"  # the container's init or pvegpu itself: never signalled


@dataclass(frozen=True)
class TaskResult:
    """A finished PVE task (``pvesh get /nodes/<node>/tasks/<upid>/status``): exitstatus OK or WARNINGS: n."""

    upid: str
    exitstatus: str
    log_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcIdentity:
    """A process that cannot be confused with a later one: pid + start time (stat field 22)."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class ProcInfo:
    """What ``ps -o pid,stat,comm,cgroup`` and ``/proc/<pid>/status`` (NSpid) say about a process."""

    ident: ProcIdentity
    comm: str
    state: str  # R S D Z T ...
    placement: Placement
    cgroup: str
    ns_pid: int | None  # pid inside the container's PID namespace (not a nested one's); None outside a CT
    is_ct_init: bool = False  # PID 1 of its container
    ppid: int | None = None  # parent pid on the host (stat field 4), to name who respawned a holder
    uid: int | None = None  # real uid on the host (``/proc/<pid>/status`` Uid:), for audit
    cmdline: str = ""  # escaped ``/proc/<pid>/cmdline`` (tenant text: display only, never decide on it)
    term_futile: bool = False  # SIGTERM cannot reach it: ignored (SigIgn), or a nested namespace's init without a handler
    pgid: int | None = None  # process group id on the host (stat field 5): a fork child keeps its group leader's pid
    sid: int | None = None  # session id on the host (stat field 6): a fork child keeps its session leader's pid
    frozen: bool = False  # its cgroup (or an ancestor up to the container's) is frozen (cgroup v2 cgroup.events frozen 1)

    @property
    def pid(self) -> int:
        return self.ident.pid


@dataclass(frozen=True)
class SeenPid:
    """What pvegpu's earlier runs saw of one NVML-listed pid (the record that lasts between runs, ``Host.seen_pids``):
    the start time and placement of its process when last seen alive and listed (None: never seen so), and when it
    was first seen listed but dead (boot-time ticks, the unit of a start time; None: not seen dead)."""

    start_ticks: int | None = None
    placement: Placement | None = None
    dead_since: int | None = None


class Via:
    """How a holder was seen: the closed vocabulary of ``Holding.via`` and ``Holder.via`` (the words are the JSON's)."""

    NVML = "nvml"  # NVML lists the pid on that GPU
    FD = "fd"  # an open descriptor of the GPU's device node
    MAPS = "maps"  # a mapping of the device node (where a CUDA context's memory lives)
    UNREADABLE = "unreadable"  # this process could not be fully read (permissions, or over budget)
    STUCK = "stuck"  # with UNREADABLE: reading it blocked in the kernel (a hung mount)
    BUDGET = "budget"  # with UNREADABLE: the per-process scan budget ran out (or the whole scan's)
    ALL = frozenset({NVML, FD, MAPS, UNREADABLE, STUCK, BUDGET})


@dataclass(frozen=True)
class Holding:
    """Which GPUs a process holds open (``fuser -v /dev/nvidia*``): minors, and how it was seen."""

    pid: int
    minors: frozenset[int]
    via: frozenset[str]  # words of ``Via``
    # the minors whose device node it maps, when its mappings were read (None: not told per GPU, so a mapping counts
    # for each of ``minors``): a rank of a tensor-parallel job opens every GPU's node but maps its own GPU's only
    mapped: frozenset[int] | None = None


@dataclass(frozen=True)
class Holder:
    """A live process that holds a GPU, with its identity and placement."""

    info: ProcInfo
    minors: frozenset[int]
    via: frozenset[str]

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def could_own_context(self) -> bool:
        """NVML lists it or it maps the device: it may hold GPU memory. An fd alone is an NVML client
        (nvidia-persistenced, DCGM, exporters), which holds none."""
        return Via.NVML in self.via or Via.MAPS in self.via


@dataclass(frozen=True)
class CtGpus:
    """The GPUs a container's configuration grants: minors, or all of them."""

    minors: frozenset[int]
    all_gpus: bool = False
    sources: tuple[str, ...] = ()  # config lines that granted them
    notes: tuple[str, ...] = ()  # pending/snapshot/lock remarks, reported not used


@dataclass
class Step:
    """One thing reset did, in order: what, outcome, details (pids, bytes)."""

    name: str
    outcome: str
    detail: dict[str, object] = field(default_factory=dict)
