"""The narrow interfaces the core needs; adapters implement them, fakes too.

Each method names its manual equivalent so an admin can reproduce any step by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pvegpu.core.model import (
    CtStatus,
    GpuHealth,
    GpuInfo,
    GpuSample,
    Guest,
    Holding,
    ProcIdentity,
    ProcInfo,
    SeenPid,
    SignalResult,
    TaskResult,
)
from pvegpu.health.kernlog import KernelEvents


class EventLog(Protocol):
    """A structlog-like logger: ``log.info("reset.sigterm", pid=...)``."""

    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def debug(self, event: str, **kw: Any) -> Any: ...


class NullLog:
    """Drops every event (the hook's default: its only output is its verdict)."""

    def info(self, event: str, **kw: Any) -> None:
        return None

    warning = debug = info


class LockPort(Protocol):
    """The reset's own lock of the container (``adapters/locks.py``): what it records for the start gate and for
    the next reset. The simulated-clock tests use ``NullLockPort``."""

    def earlier(self) -> str | None:
        """What a previous reset left undone (its stop request, never followed by a running CT), or None."""
        ...

    def stop_requested(self) -> None: ...
    def running_again(self) -> None: ...

    def starting(self, seconds: float) -> None:
        """The reset starts its own container now: the container's pre-start gate passes this lock for ``seconds``."""
        ...

    def started(self) -> None: ...


class NullLockPort:
    """No lock to mark (tests of the state machine, the post-stop reclaim)."""

    def earlier(self) -> str | None:
        return None

    def stop_requested(self) -> None:
        return None

    running_again = stop_requested
    started = stop_requested

    def starting(self, seconds: float) -> None:
        return None


class Interrupted(BaseException):
    """A signal (SIGINT, SIGTERM, SIGHUP) ends the run here: before any stop was requested, or, inside the
    critical section, a second signal abandons the restart. A BaseException, so that no ``except PvegpuError``
    or ``except Exception`` on the way takes it for an API failure."""

    def __init__(self, signame: str, exit_code: int, abandoned: bool = False) -> None:
        super().__init__(signame)
        self.signame, self.exit_code, self.abandoned = signame, exit_code, abandoned


class Interrupts(Protocol):
    """Signals during a reset (the CLI's handlers). From ``critical()`` on (the stop request), the first signal
    is only recorded: the restart is finished first; ``received()`` then names it (name, exit code 128+n)."""

    def critical(self) -> None: ...
    def received(self) -> tuple[str, int] | None: ...


class NoInterrupts:
    """No signal handling (the state machine's tests, the hook)."""

    def critical(self) -> None:
        return None

    def received(self) -> tuple[str, int] | None:
        return None


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class WallClock(Clock, Protocol):
    """A Clock that also tells the wall time (``time.time()``): the audit's ``generated_at``."""

    def time(self) -> float: ...


class GpuProbe(Protocol):
    """Host-side NVML."""

    def gpus(self) -> list[GpuInfo]:
        """``nvidia-smi --query-gpu=index,minor_number,uuid,pci.bus_id --format=csv``. Raises GpuQueryError."""
        ...

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        """Memory v2 used + compute/graphics/MPS PIDs per GPU (``nvidia-smi --query-compute-apps=pid,used_memory``).

        A GPU that cannot be read comes back with ``used_bytes=None`` and an ``error``; never raises for one GPU.
        """
        ...


class Host(Protocol):
    """``/proc``, cgroups and signals on the node."""

    self_pid: int

    def describe(self, pid: int) -> ProcInfo | None:
        """``cat /proc/<pid>/{stat,status,cgroup}``; None when the pid does not exist."""
        ...

    def ct_pids(self, vmid: int) -> list[int]:
        """Every pid in the container's cgroup (``cat /sys/fs/cgroup/lxc/<vmid>/**/cgroup.procs``)."""
        ...

    def ct_init(self, vmid: int) -> int | None:
        """The container's running init (PID 1 of its namespace) as a host pid (``lxc-info -p -n <vmid>``), or None."""
        ...

    def holdings(self, pids: Iterable[int] | None = None, *, deep: bool = False) -> dict[int, Holding]:
        """GPU device fds and mappings per pid (``fuser -v /dev/nvidia*``, by device number); None = all pids.

        Mappings are read only for processes whose fds show no GPU, unless ``deep``: then also for those,
        to tell a process that maps the device (it may own a CUDA context) from an NVML client (an fd only).
        """
        ...

    def alive(self, ident: ProcIdentity) -> bool:
        """True while that very process exists and is not a zombie."""
        ...

    def boot_ticks(self) -> int | None:
        """The boot-time clock now, in the unit of a process's start time (``/proc/<pid>/stat`` field 22: clock ticks
        since boot; ``cat /proc/uptime``): a process whose start time is later started after this call. None when
        it cannot be told."""
        ...

    def seen_pids(self) -> dict[int, SeenPid] | None:
        """The record of NVML-listed pids earlier runs kept (``cat /run/pvegpu/pids/seen.json``); None when there is
        none this boot or it cannot be trusted (unreadable, not root's): then nothing is known of earlier runs."""
        ...

    def keep_seen_pids(self, record: dict[int, SeenPid]) -> None:
        """Replace the record with ``record`` (best effort: a record that cannot be written is no error)."""
        ...

    def signal(self, ident: ProcIdentity, sig: int, vmid: int) -> SignalResult:
        """``kill -SIG <pid>`` through a pidfd, only if the pid is still that process in CT vmid."""
        ...


class PveReader(Protocol):
    """The reads the start gate needs (``/etc/pve`` on the node): never the API, never a power action."""

    def local_node(self) -> str | None:
        """``hostname`` as PVE knows it, when running on a PVE node."""
        ...

    def where(self, vmid: int) -> Guest | None:
        """``pvesh get /cluster/resources --type vm`` (or ``/etc/pve/.vmlist``) for one vmid."""
        ...

    def guests(self) -> list[Guest]:
        """Every guest of the cluster."""
        ...

    def ct_config(self, guest: Guest) -> str | Mapping[str, Any]:
        """``pvesh get /nodes/<node>/lxc/<vmid>/config --current 1``, or the raw ``.conf`` text when local."""
        ...


class PveApi(PveReader, Protocol):
    """The Proxmox operations reset and audit need."""

    def ct_status(self, guest: Guest) -> CtStatus:
        """``pvesh get /nodes/<node>/lxc/<vmid>/status/current``."""
        ...

    def ct_stop(self, guest: Guest) -> str:
        """``pvesh create /nodes/<node>/lxc/<vmid>/status/stop``; returns the task UPID."""
        ...

    def ct_start(self, guest: Guest) -> str:
        """``pvesh create /nodes/<node>/lxc/<vmid>/status/start``; returns the task UPID."""
        ...

    def task_status(self, node: str, upid: str) -> Mapping[str, Any]:
        """``pvesh get /nodes/<node>/tasks/<upid>/status``."""
        ...

    def task_log(self, node: str, upid: str, limit: int = 50) -> list[str]:
        """``pvesh get /nodes/<node>/tasks/<upid>/log``; the last lines."""
        ...

    def wait_task(self, node: str, upid: str, *, timeout: float, what: str, progress: Any = None) -> TaskResult:
        """Poll ``pvesh get /nodes/<node>/tasks/<upid>/status`` until the task stops (bounded by ``timeout``);
        ``progress(text)``, if given, hears about a wait longer than a second.

        Returns the result when exitstatus is OK or WARNINGS; raises TaskFailed (with the log tail) or
        TaskTimeout. ``what`` names the task in messages ("stop task of CT 129").
        """
        ...


class GpuHealthProbe(Protocol):
    """Host-side NVML health readings (the audit's; optional: a probe without it shows health unknown)."""

    def health(self, minor: int) -> GpuHealth:
        """``nvidia-smi -q -i <minor> -d MEMORY,ROW_REMAPPER,PAGE_RETIREMENT`` and ``nvidia-smi --query-gpu=mig.mode.current``."""
        ...


class KernelLog(Protocol):
    """The kernel log since boot, reduced to the GPUs' Xids and resets (``adapters/kernlog.py``)."""

    def events(self) -> KernelEvents:
        """``dmesg --raw | grep -e NVRM -e 'GPU reset'``, bounded; never raises: unreadable is ``error`` set (unknown)."""
        ...

    def write(self, text: str) -> None:
        """Add one record (``health.reset_record``: a verified GPU reset ends that GPU's Xids). Raises OSError."""
        ...


class GpuControl(Protocol):
    """What ``pvegpu gpu-reset`` changes on a GPU (``adapters/smi.py``: ``nvidia-smi`` under a deadline; a simulated
    node's stand-in). Each call raises ``GpuQueryError`` with the tool's own words when it fails."""

    def persistence(self, gpu: GpuInfo, on: bool) -> None:
        """``nvidia-smi -i <uuid> -pm 0|1``."""
        ...

    def reset(self, gpu: GpuInfo) -> None:
        """``nvidia-smi -r -i <uuid>``."""
        ...

    def fabric_manager(self) -> bool | None:
        """Is NVIDIA Fabric Manager running on the node (``systemctl is-active nvidia-fabricmanager``)? None: cannot tell."""
        ...


class NodeFiles(Protocol):
    """The node's files the audit checks (device nodes, snippets, VM configs, PCI drivers)."""

    def exists(self, path: str) -> bool:
        """``test -e <path>`` (for ``/dev/nvidia*`` device nodes)."""
        ...

    def snippet_path(self, volid: str) -> str | None:
        """The file a hookscript volume id names (``pvesm path local:snippets/x``); None when not a file storage."""
        ...

    def read_pve(self, relpath: str) -> str | None:
        """``cat /etc/pve/<relpath>`` (VM configs, ``mapping/pci.cfg``); None when absent or unreadable."""
        ...

    def pci_driver(self, bus_id: str) -> str | None:
        """``basename $(readlink /sys/bus/pci/devices/<bus_id>/driver)``; "" = no driver bound, None = no such device."""
        ...

    def running_cts(self) -> frozenset[int] | None:
        """Running containers by PVE's own test, one read for all (``grep /var/lib/lxc/ /proc/net/unix``); None = cannot tell."""
        ...

    def driver_version(self) -> str | None:
        """The host's NVIDIA kernel module version (``cat /proc/driver/nvidia/version``); None when unreadable."""
        ...

    def ct_lib_versions(self, vmid: int, init_pid: int) -> frozenset[str] | None:
        """NVIDIA driver versions of the library files in a running container's root, through its init (file names
        only, never following its links); None (unknown) when its root or a lib directory cannot be read in full."""
        ...

    def pci_vendor(self, bus_id: str) -> str | None:
        """``cat /sys/bus/pci/devices/<bus_id>/vendor`` (``0x10de`` is NVIDIA); None when unreadable."""
        ...
