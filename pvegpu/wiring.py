"""The composition root: the one place that reads the settings, builds the ports and derives the policies.

One node world per command run: ``world(s)`` chooses once between the simulated node (``pvegpu demo``, tests)
and this node (``/etc/pve`` + the API, NVML, ``/proc``) and hands out typed ports (``NodeWorld``): reset's
``Ports``, the audit's ``AuditPorts``. The start gate's light path (``gate_ports``: ``/etc/pve``, the ctypes
NVML reader, ``/proc``; never the API) stays apart so it imports as little as it can. ``cli`` and ``hook`` call
only this module; nothing below it imports it. The gate path imports this module too, so adapters are imported
inside the functions that need them.
"""

from __future__ import annotations

import os

from . import errors as E
from .record import record

TYPE_CHECKING = False  # typing is not imported at run time: the start gate pays for every import
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from .adapters.agent import ProxmoxerVm
    from .adapters.bounded import BoundedProbe
    from .adapters.locks import ct_lock as CtLock
    from .adapters.nvml_warm import NvmlWarmup
    from .adapters.pve import ProxmoxerPve
    from .adapters.ssh import SshAudits
    from .gate import GatePolicy, GatePorts
    from .leftover import LeftoverRule
    from .model import GpuInfo, GpuSample
    from .ports import EventLog, GpuProbe, Host, NodeFiles, PveApi, WallClock
    from .reset.report import Ports, ResetPolicy
    from .settings import Settings
    from .vmreset import VmPolicy


@record(frozen=True)
class GlobalOptions:
    """The options every command honours, given before it (``pvegpu --config FILE reset 129``; ``pvegpu.cli``)."""

    config: str | None = None
    simulate: str | None = None


def settings(opts: GlobalOptions, overrides: Mapping[str, object] | None = None) -> Settings:
    """Settings from ``--config`` (or PVEGPU_CONFIG, or /etc/pvegpu/pvegpu.toml), PVEGPU_* and flag overrides.

    A simulated node keeps its run-time state (reset locks, allow-once tokens, any ``*_dir`` of the settings)
    in its own directory, unless a setting says otherwise: ``--simulate`` never touches this node's real state,
    nor reads or writes the settings snapshot in ``/run/pvegpu``.
    """
    extra = dict(overrides or {})
    if opts.simulate:
        _usable_sim(opts.simulate, f"--simulate {opts.simulate}")
        extra["simulate"] = opts.simulate
    from .adapters.settingsfile import load

    s = load(opts.config, overrides=extra, **({"snapshot_dir": None} if opts.simulate else {}))
    if s.simulate and not opts.simulate:  # PVEGPU_SIMULATE or the settings file's `simulate`
        _usable_sim(s.simulate, f"PVEGPU_SIMULATE={s.simulate}" if os.environ.get("PVEGPU_SIMULATE") == s.simulate
                    else f"the setting simulate = {s.simulate!r}")
    return simulated_state(s) if s.simulate else s


def _usable_sim(directory: str, named: str) -> None:
    """A simulated node this user can use: its ``scenario.json`` opens; else one line and exit 2 (a directory that
    is none, or another user's node, e.g. root's), never an internal error further on."""
    try:
        os.close(os.open(os.path.join(directory, "scenario.json"), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except PermissionError:
        raise E.UsageError(f"{named}: permission denied to uid {os.geteuid()}: a simulated node is its maker's",
                           "use it as the user who made it, or make your own: `pvegpu sim create DIR`") from None
    except OSError:
        raise E.UsageError(f"{named}: not a simulated node (no scenario.json there)", _sim_hint(directory)) from None


def _sim_hint(directory: str) -> str:
    """What to run instead: ``sim create`` of that directory only when it could be one (absent or empty), else of
    a new directory (``sim create`` never builds into a directory already holding files: ``/etc`` is no node)."""
    try:
        fresh = not os.path.lexists(directory) or (os.path.isdir(directory) and not os.listdir(directory))
    except OSError:
        fresh = False
    where = directory if fresh else "/tmp/pvegpu-node"
    return (f"`pvegpu sim create {where}` builds one{'' if fresh else ' in a new directory'} (README: Simulated node); "
            "`pvegpu demo` builds and removes one")


SIM_STATE = {"lock_dir": "lock", "override_dir": "allow-once"}  # where under the simulated node's dir; else the key's stem


def simulated_state(s: Settings) -> Settings:
    """``s`` with every state directory still at its real default moved under the simulated node's directory."""
    from .record import fields, is_record, replace

    assert s.simulate
    changes: dict[str, object] = {}
    for f in fields(s):
        section = getattr(s, f.name)
        if not is_record(section) or isinstance(section, type):
            continue
        moved: dict[str, object] = {g.name: os.path.join(s.simulate, SIM_STATE.get(g.name, g.name.removesuffix("_dir")))
                 for g in fields(section) if g.name.endswith("_dir") and getattr(section, g.name) == g.default}
        if moved:
            changes[f.name] = replace(section, **moved)
    return replace(s, **changes)  # type: ignore[arg-type]  # each value is the section of its own name, replaced


def no_pve(pve_root: str) -> E.PvegpuError:
    """Why there is no Proxmox VE to read: ``/etc/pve`` empty (pmxcfs down, exit 4), or absent (not a node, exit 3)."""
    try:
        empty = os.path.isdir(pve_root) and not os.listdir(pve_root)
    except OSError:
        empty = False
    return E.PmxcfsDownError(pve_root) if empty else E.NotPveNodeError(pve_root)


# -- policies: every default comes from settings.py ------------------------------------------------------


def leftover_rule(s: Settings) -> LeftoverRule:
    """``[leftover]``: the one rule reset's verify, the gate, audit and the diagnosis judge leftover memory by."""
    from .leftover import LeftoverRule
    from .model import MIB

    return LeftoverRule(s.leftover.threshold_mib * MIB, int(s.leftover.per_context_mib * MIB))


def reset_policy(s: Settings, *, dry_run: bool = False) -> ResetPolicy:
    """``[reset]`` as the state machine's policy."""
    from .reset.report import ResetPolicy

    r, rule = s.reset, leftover_rule(s)
    return ResetPolicy(grace=r.grace, kill_wait=r.kill_wait, timeout=r.timeout, poll=r.poll, settle=r.settle, rounds=r.rounds,
                       threshold_bytes=rule.threshold_bytes, per_context_bytes=rule.per_context_bytes, restart=r.restart, dry_run=dry_run, task_timeout=r.task_timeout)


def post_stop_policy(s: Settings) -> ResetPolicy:
    """The post-stop reclaim: the reset policy, never restarting, with short waits (PVE waits for the hook)."""
    from .record import replace

    p = reset_policy(s)
    return replace(p, restart=False, grace=min(p.grace, 2.0), timeout=max(min(p.timeout, 2.0), p.settle + p.poll))


def gate_policy(s: Settings) -> GatePolicy:
    """``[gate]`` as the start gate's policy."""
    from .gate import GatePolicy

    g = s.gate
    return GatePolicy(leftover_rule(s), g.on_unknown, frozenset(g.exclusive), g.exclusive_tag, g.host_users)


# -- the start gate's light ports ------------------------------------------------------------------------


class UnreadableGpus:
    """A GpuProbe for when NVML itself cannot start: every GPU is unknown, never zero."""

    def __init__(self, error: E.GpuQueryError) -> None:
        self.error = error

    def gpus(self) -> list[GpuInfo]:
        raise self.error

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        from .model import GpuSample

        return {m: GpuSample(m, None, None, self.error.message) for m in minors}


def warm_nvml(simulate: str | None) -> NvmlWarmup | None:
    """NVML started in a thread now, for a reader to take over (``gate_ports``, ``LazyNvml``); None on a simulated
    node (``simulate``: its directory)."""
    if simulate:
        return None
    from .adapters.nvml_warm import NvmlWarmup

    return NvmlWarmup()


def gate_ports(s: Settings, warm: NvmlWarmup | None = None) -> GatePorts:
    """``/etc/pve``, the ctypes NVML reader (taking over ``warm``) and ``/proc``: what the hookscript may touch."""
    from .adapters.locks import reset_running
    from .gate import GatePorts

    def running(vmid: int) -> bool:
        return reset_running(s.reset.lock_dir, vmid)

    if s.simulate:
        pve, probe, host = _sim_ports(s)
        return GatePorts(pve, probe, host, running)
    from .adapters.etcpve import EtcPve
    from .adapters.procfs import ProcHost

    if not EtcPve.present(s.pve_root):
        raise no_pve(s.pve_root)
    from .adapters.procfs import ScanBudget

    # each of the (at most two) process scans gets under a third of the deadline: a verdict, not a timeout
    probe = _OpenedOnFirstRead(warm) if warm is not None else _lite_nvml()
    return GatePorts(EtcPve(s.pve_root, node=s.node, local_first=True), probe, ProcHost(budget=ScanBudget(total=s.gate.deadline * 0.3)), running)


class _OpenedOnFirstRead:
    """The gate's NVML reader, taking over ``warm`` at its first reading rather than when the ports are made: the
    guest's config and processes are read while NVML's start (``adapters/nvml_warm.py``) finishes in its thread (on
    the H200 its GPU attach alone is ~7 ms). The same reader and answers; ``failed`` as the reader's."""

    def __init__(self, warm: NvmlWarmup) -> None:
        self._warm: NvmlWarmup | None = warm
        self._probe: GpuProbe | None = None

    def _opened(self) -> GpuProbe:
        if self._probe is None:
            warm, self._warm = self._warm, None
            self._probe = _lite_nvml(warm)
        return self._probe

    def gpus(self) -> list[GpuInfo]:
        return self._opened().gpus()

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        return self._opened().sample(minors)

    @property
    def failed(self) -> list[str]:
        """The reader's: the GPUs its last ``gpus()`` could not read, and why (none before a reading)."""
        return list(getattr(self._probe, "failed", ())) if self._probe is not None else []


def gate_files(s: Settings) -> NodeFiles:
    """The node's files the VM gate reads: VM configs and ``mapping/pci.cfg`` in ``/etc/pve``, PCI drivers in sysfs."""
    if s.simulate:
        from .sim.nodefiles import SimNodeFiles

        return SimNodeFiles(s.simulate)
    from .adapters.nodefiles import LocalNodeFiles

    return LocalNodeFiles(s.pve_root)


def _lite_nvml(warm: NvmlWarmup | None = None) -> GpuProbe:
    try:
        from .adapters.nvml_lite import NvmlLite

        return NvmlLite(warm=warm)
    except E.GpuQueryError as exc:
        return UnreadableGpus(exc)


def _sim_ports(s: Settings) -> tuple[PveApi, GpuProbe, Host]:
    from .sim.scenario import SimNode

    return SimNode(s.simulate).ports()


# -- the real node -----------------------------------------------------------------------------------------


def resolve_backend(s: Settings) -> str | None:
    """local (pvesh as root on a node), https, or None when no API can be used."""
    from .adapters.etcpve import EtcPve

    if s.api.backend != "auto":
        return s.api.backend
    if s.api.host:
        return "https"
    if EtcPve.present(s.pve_root) and os.geteuid() == 0:
        return "local"
    return None


def api_client(s: Settings, node: str = "") -> ProxmoxerPve | None:
    """A ProxmoxerPve for the configured backend, or None; connects on the first call that needs it."""
    backend = resolve_backend(s)
    if backend is None:
        return None
    from .adapters.pve import ProxmoxerPve, connect

    # pvesh runs stop/start synchronously: those get the task deadline, every read api.timeout
    return ProxmoxerPve(connect(s.api, backend, task_timeout=s.reset.task_timeout), node=node)


def pve_port(s: Settings) -> PveApi:
    """The PveApi: ``/etc/pve`` reads on the node, the API for power actions (and for reads off the node)."""
    if s.simulate:
        return _sim_ports(s)[0]
    from .adapters.etcpve import EtcPve, NodePve

    local = EtcPve(s.pve_root, node=s.node, local_first=True) if EtcPve.present(s.pve_root) else None  # where(): no .vmlist json
    has_api = resolve_backend(s) is not None
    if local is None and not has_api:
        raise no_pve(s.pve_root)
    node = s.node or (local.local_node() if local else "") or ""
    return NodePve(local, (lambda: api_client(s, node)) if has_api else None)


def vm_api(s: Settings) -> ProxmoxerVm:
    """The VM reset's API (config, status, power, guest agent exec): https with a token, or pvesh on the node."""
    from .adapters.etcpve import EtcPve

    node = s.node or (EtcPve(s.pve_root, node=s.node).local_node() if EtcPve.present(s.pve_root) else "") or ""
    api = None if s.simulate else api_client(s, node)
    if api is None:
        raise E.UsageError("a VM reset works through the Proxmox API and its guest agent, and none can be used here",
                           "run it as root on a PVE node (pvesh), or set api.host and an API token (README 'VMs')")
    from .adapters.agent import ProxmoxerVm

    return ProxmoxerVm(api)


def system_clock() -> WallClock:
    from .adapters.clock import SystemClock

    return SystemClock()


def vm_policy(s: Settings, *, dry_run: bool = False) -> VmPolicy:
    """``[reset]`` as the VM reset's policy (each guest command bounded by the poll-independent exec deadline)."""
    from .vmreset import VmPolicy

    r = s.reset
    return VmPolicy(grace=r.grace, kill_wait=r.kill_wait, timeout=r.timeout, settle=r.settle, restart=r.restart, dry_run=dry_run,
                    task_timeout=r.task_timeout, exec_timeout=max(2.0, min(30.0, r.timeout)),
                    shutdown_timeout=max(1, int(min(60.0, r.task_timeout / 2))), poll=max(r.poll, 0.2), rounds=r.rounds)


def read_deadline(s: Settings) -> float:
    """How long one GPU reading may take before it is abandoned as unknown (NVML stuck in the driver)."""
    return max(0.2, min(2.0, s.reset.timeout / 2))


def bounded(probe: GpuProbe, s: Settings) -> BoundedProbe:
    """``probe`` with every reading under ``read_deadline``: a read that hangs is unknown, never a hang."""
    from .adapters.bounded import BoundedProbe

    return BoundedProbe(probe, read_deadline(s))


def bounded_opening(opener: Callable[[], GpuProbe], s: Settings) -> BoundedProbe:
    """A GpuProbe opened by ``opener`` at its first reading, in the bounded worker of that reading: NVML's start
    stuck in the driver is, like any read, over within the read deadline (``BoundedProbe``)."""
    from .adapters.bounded import BoundedProbe

    return BoundedProbe(None, read_deadline(s), opener=opener)


def started(probe: BoundedProbe) -> BoundedProbe:
    """``probe`` opened now (``BoundedProbe.start``): NVML that cannot start, or does not within the read deadline,
    is a GpuQueryError here (``pvegpu audit`` reports it and still checks the configs)."""
    probe.start()
    return probe


def open_nvml() -> GpuProbe:
    """NVML for ``pvegpu audit`` (bus ids, total memory, health): the ctypes reader with details, which reads what
    nvidia-ml-py's reader (``adapters/nvml.py``, the reference a GPU test compares it with) reads, without its
    import (~13 ms of every audit); raises GpuQueryError when NVML cannot start."""
    from .adapters.nvml_lite import NvmlLite

    return NvmlLite(details=True)


def open_nvml_lite(warm: NvmlWarmup | None = None) -> GpuProbe:
    """The ctypes NVML reader (``pvegpu reset``, the gate): the same structs and rules as nvidia-ml-py
    (a GPU test checks they agree), without its ~50 ms import; raises GpuQueryError when NVML cannot start.
    ``warm``: NVML already being started in a thread (``warm_nvml``), taken over."""
    from .adapters.nvml_lite import NvmlLite

    return NvmlLite(warm=warm)


PROC_SCAN_TOTAL = 15.0  # seconds one process scan of reset/audit may take (audit's unit allows 50 s in all)


def proc_host() -> Host:
    """``/proc``, cgroupfs and pidfd signals of this node: the one ``scan_ahead`` started, else a new one."""
    if _AHEAD:
        return _AHEAD.pop()
    from .adapters.procfs import ProcHost, ScanBudget

    return ProcHost(budget=ScanBudget(total=PROC_SCAN_TOTAL))


_AHEAD: list[Host] = []  # this node's host, its whole-node scan already started (``scan_ahead``), for ``world``


def scan_ahead(opts: GlobalOptions) -> None:
    """``pvegpu audit`` of this node: start its whole-node scan now, before the settings, NVML and the configs are
    read (``ProcHost.prefetch``; the scan depends on none of them); ``world`` takes this host, and a simulated node
    (the settings may name one) ends it. ``end_scan_ahead()`` when the command ends."""
    if opts.simulate or _AHEAD:
        return
    host = proc_host()
    prefetch = getattr(host, "prefetch", None)
    if prefetch is not None:
        prefetch(deep=True)  # as the audit's whole-host reading scans (``inspect_gpus``)
    _AHEAD.append(host)


def end_scan_ahead() -> None:
    """End a scan ``scan_ahead`` started that no command took (the settings failed, or named a simulated node)."""
    while _AHEAD:
        cancel = getattr(_AHEAD.pop(), "cancel_prefetch", None)
        if cancel is not None:
            cancel()


class LazyNvml:
    """NVML opened on the first reading (so a bad vmid is reported before NVML is touched), every reading
    bounded, and closed by ``close()``: a resident NVML client would block ``nvidia-smi -r`` and show up as a holder."""

    def __init__(self, s: Settings) -> None:
        self._probe: BoundedProbe | None = None
        self._warm: NvmlWarmup | None = None
        self._s = s

    def warm_up(self) -> None:
        """Start NVML now in a thread (the guest is known to be a container), so that the first reading finds it
        started: its ~20 ms go by beside the reset's imports, lock and ``/etc/pve`` reads."""
        if self._probe is None and self._warm is None:
            self._warm = warm_nvml(None)

    def _open(self) -> BoundedProbe:
        if self._probe is None:
            warm, self._warm = self._warm, None  # one warm-up, one NVML start: a reopen after close starts afresh
            # NVML's start (the warm-up's join, or nvmlInit) runs in the bounded worker too: a start stuck in the
            # driver is an unknown reading within the read deadline, never a hang of the reset
            self._probe = bounded_opening(lambda: open_nvml_lite(warm), self._s)
        return self._probe

    def gpus(self) -> list[GpuInfo]:
        return list(self._open().gpus())

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        return dict(self._open().sample(minors))

    @property
    def failed(self) -> list[str]:
        """GPUs the last ``gpus()`` could not read (lost), and why: a granted GPU among them is unknown."""
        return list(getattr(self._probe, "failed", ())) if self._probe is not None else []

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None


@record
class Node:
    """Open ports of one command run: ``with world.reset_ports(log) as ports:`` releases NVML at the end."""

    ports: Ports
    closers: tuple[Callable[[], None], ...] = ()

    def __enter__(self) -> Ports:
        return self.ports

    def __exit__(self, *exc: object) -> None:
        for close in self.closers:
            close()


@record
class AuditPorts:
    """What ``pvegpu audit`` reads through: NVML opened for one run only, PVE, ``/proc``, node files."""

    open_probe: Callable[[], GpuProbe]  # closed after the run
    pve: PveApi
    host: Host
    files: NodeFiles
    threshold_bytes: LeftoverRule  # the leftover rule (``[leftover]``); the name is the one callers pass on
    clock: WallClock  # the run's duration and the document's generated_at
    users: Callable[[int], str | None] | None = None  # uid -> the host's user name, or None
    done: Callable[[], None] = lambda: None  # after the run: ends a whole-node scan started ahead that no reading took


class NodeWorld:
    """One node, simulated or this one, chosen once (``world(s)``): the ports every command of the run shares.

    ``reset_probe``: GPU readings for reset (bounded; on a node the ctypes reader, opened at the first reading);
    ``audit_probe``: GPU readings and health for audit (bounded, NVML's start included; on a node the ctypes reader
    with details). A plain class, not a
    dataclass: the gate's path imports this module and pays for each class it builds."""

    __slots__ = ("settings", "simulated", "pve", "host", "files", "clock", "reset_probe", "audit_probe", "warm_up")

    def __init__(self, settings: Settings, simulated: bool, pve: PveApi, host: Host, files: NodeFiles, clock: WallClock,
                 reset_probe: Callable[[], GpuProbe], audit_probe: Callable[[], GpuProbe],
                 warm_up: Callable[[], None] = lambda: None) -> None:
        self.settings, self.simulated, self.pve, self.host, self.files, self.clock = settings, simulated, pve, host, files, clock
        self.reset_probe, self.audit_probe = reset_probe, audit_probe
        self.warm_up = warm_up  # reset's NVML started now in a thread (``LazyNvml.warm_up``); nothing on a simulated node

    def reset_ports(self, log: EventLog | None = None, *, exiting: bool = False) -> Node:
        """Ports for ``pvegpu reset`` (and the post-stop reclaim); NVML is closed when the ``with`` ends. ``exiting``:
        the process ends right after (the command line's reset): NVML is closed behind, in a thread of its own
        (``_behind``), while the verdict is written; ``nvmlShutdown`` (~3-8 ms on the H200) is then not waited for,
        neither before the verdict nor by the kernel at exit."""
        from .ports import NullLog
        from .reset.report import Ports

        probe = self.reset_probe()
        close = getattr(probe, "close", None)
        if close is not None and exiting:
            close = _behind(close)
        closers: tuple[Callable[[], None], ...] = (close,) if close is not None and not self.simulated else ()
        return Node(Ports(self.pve, probe, self.host, self.clock, log or NullLog()), closers)

    def audit_ports(self, *, scan_ahead: bool = False) -> AuditPorts:
        """Ports for ``pvegpu audit``: NVML opened for the run only. ``scan_ahead``: this node's whole-node scan is
        started now in forked workers (``ProcHost.prefetch``), to run while NVML and the configs are read; call
        ``done()`` after the run."""
        prefetch, cancel = getattr(self.host, "prefetch", None), getattr(self.host, "cancel_prefetch", None)
        ports = AuditPorts(self.audit_probe, self.pve, self.host, self.files, leftover_rule(self.settings), self.clock, user_names())
        if scan_ahead and prefetch is not None and cancel is not None:
            prefetch()
            ports.done = cancel
        return ports


def _behind(close: Callable[[], None]) -> Callable[[], None]:
    """``close`` run in a thread of its own (``workers.Worker``), not waited for: the process is about to end (its
    exit would close NVML's files anyway), and what it raises then is nobody's to report."""
    def start() -> None:
        from .adapters.workers import Worker

        Worker(close)

    return start


def world(s: Settings, *, warm_ct: int | None = None) -> NodeWorld:
    """The node this run works on: the simulated node under ``s.simulate``, else this node (the only branch).
    ``warm_ct``: when that vmid is a container of this node (its config is in this node's directory), NVML's start
    begins before the rest is built (``LazyNvml.warm_up``: a reset's first reading waits for it)."""
    if s.simulate:
        from .sim.nodefiles import SimNodeFiles

        end_scan_ahead()  # a scan of this node started before the settings named a simulated one
        pve, probe, host = _sim_ports(s)
        sim_probe = bounded(probe, s)
        return NodeWorld(s, True, pve, host, SimNodeFiles(s.simulate), system_clock(), lambda: sim_probe, lambda: bounded(probe, s))
    lazy = LazyNvml(s)  # one per run: the warm-up it may have started is the one its first reading takes over
    if warm_ct is not None and _local_ct(s, warm_ct):
        lazy.warm_up()
    from .adapters.nodefiles import LocalNodeFiles

    return NodeWorld(s, False, pve_port(s), proc_host(), LocalNodeFiles(s.pve_root), system_clock(),
                     lambda: lazy, lambda: started(bounded_opening(open_nvml, s)), lazy.warm_up)


def _local_ct(s: Settings, vmid: int) -> bool:
    """``vmid`` is a container of this node, as its config directory in ``/etc/pve`` says."""
    from .adapters.etcpve import EtcPve

    if not EtcPve.present(s.pve_root):
        return False
    guest = EtcPve(s.pve_root, node=s.node).local_guest(vmid)
    return guest is not None and guest.type == "lxc"


def user_names() -> Callable[[int], str | None]:
    """uid -> the host's user name (None when it has none): the audit shows names, not ``uid 0``."""
    from .adapters.users import user_name

    return user_name


def node(s: Settings, log: EventLog | None = None) -> Node:
    """Ports for reset: ``world(s).reset_ports(log)``."""
    return world(s).reset_ports(log)


def audit_ports(s: Settings) -> AuditPorts:
    """Ports for ``pvegpu audit``: ``world(s).audit_ports()``."""
    return world(s).audit_ports()


def write_textfile(path: str, doc: Mapping[str, object]) -> None:
    """``audit --prometheus``: the textfile, written safely into a directory the exporter's user may own."""
    from .adapters.textfile import write_textfile as write

    write(path, doc)


def cluster_audits(timeout: float, options: list[str]) -> SshAudits:
    """The other nodes' audits, over the root SSH trust PVE sets up between cluster nodes."""
    from .adapters.ssh import SshAudits

    return SshAudits(timeout=timeout, options=options)


def ct_lock(s: Settings, vmid: int, wait: float, on_wait: Callable[[str], None] | None = None, kind: str = "CT") -> CtLock:
    """The per-container reset lock (``/run/pvegpu/locks/<vmid>.lock``), as a context manager; ``on_wait(text)``
    hears about a wait for another reset's lock once a second."""
    from .adapters.locks import ct_lock as lock

    return lock(s.reset.lock_dir, vmid, wait, on_wait, kind)


def own_start(s: Settings, vmid: int) -> str | None:
    """The reset whose own restart of CT ``vmid`` is starting it now ('pid N'), or None (the gate's lock check)."""
    from .adapters.locks import own_start as own

    return own(s.reset.lock_dir, vmid)


def journal_line(line: str) -> None:
    """One line to the system log with ident pvegpu (``journalctl -t pvegpu``)."""
    from .adapters.journal import log_line

    log_line(line)


@record(frozen=True)
class InstallTarget:
    """Where ``hook install | uninstall | status`` act: the node's ``/etc/pve``, its name, a per-node snippet lister
    (None: unknown), and the runner of ``pct set`` / ``pvesm set`` (``install.Runner``)."""

    pve_root: str
    node: str
    lister: Callable[[str], set[str] | None] | None
    run: Callable[[list[str]], tuple[int, str]]


def install_target(s: Settings, storage: str, *, need_root: bool) -> InstallTarget:
    """The node ``hook install | uninstall | status`` change: this one (real ``pct``), or a simulated node, whose own
    files they change (its ``etc-pve``, its snippets directory): never this node's ``/etc/pve`` or ``/var/lib/vz``."""
    if s.simulate:
        return _sim_install_target(s, storage)
    from .install import run_command

    name, lister = install_context(s, storage, need_root=need_root)
    return InstallTarget(s.pve_root, name, lister, run_command)


def _sim_install_target(s: Settings, storage: str) -> InstallTarget:
    from .adapters.storagecfg import read_storage
    from .sim.pvecli import SimPveCli
    from .sim.scenario import SimNode

    sim = SimNode(s.simulate)
    etc = sim.state.etc_pve
    where = os.path.realpath(read_storage(etc, storage).path)
    if os.path.commonpath([where, os.path.realpath(sim.root)]) != os.path.realpath(sim.root):
        raise E.UsageError(f"--simulate {s.simulate}: storage {storage} is {where}, outside the simulated node",
                           "a simulated node's storages live in its own directory; rebuild it with `pvegpu sim create DIR`")
    return InstallTarget(etc, sim.node, None, SimPveCli(sim.root, sim.node))


def install_context(s: Settings, storage: str, *, need_root: bool) -> tuple[str, Callable[[str], set[str] | None] | None]:
    """(this node's name, a per-node snippet lister or None) for ``hook install | uninstall | status`` on the real node."""
    from .adapters.etcpve import EtcPve

    if s.simulate:  # it would run the real `pct set` on this node's real containers
        raise E.UsageError("hook install | uninstall | status of a simulated node change its own files, never this node's",
                           "use wiring.install_target")
    if need_root and os.geteuid() != 0:
        raise E.UsageError("installing the guard needs root on the node", "`pct set --hookscript` is allowed for root@pam only; run it as root")
    if not EtcPve.present(s.pve_root):
        raise no_pve(s.pve_root)
    name = EtcPve(s.pve_root, node=s.node).local_node() or ""
    try:
        api = api_client(s, name)
    except E.PvegpuError:
        api = None
    if api is None:
        return name, None

    def lister(n: str) -> set[str] | None:
        try:
            return set(api.snippets(n, storage))
        except E.PvegpuError:
            return None

    return name, lister
