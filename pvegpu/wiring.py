"""The composition root: the one place that reads the settings, builds the ports and derives the policies.

The command line (``pvegpu/cli/``) calls only this module; nothing below imports it. The node is chosen
once per run (the simulated node under ``--simulate``, else this one), and NVML is opened one way, ``nvml_reader``
(nvidia-ml-py, its start and every reading in a thread under a deadline: ``adapters/bounded.py``). What each gets:

- the start gate (``check``, ``hook VMID pre-start``): ``gate_ports`` (``/etc/pve``, never the API; NVML; ``/proc``),
  ``gate_policy``; ``gate_pve`` locates a guest; ``gate_files`` for a VM's devices; ``own_start``.
- ``reset`` of a container, and the post-stop reclaim: ``world(s).reset_ports`` (PVE: ``/etc/pve`` + the API; NVML;
  ``/proc``; clock), ``reset_policy`` / ``post_stop_policy``, ``ct_lock``; of a VM: ``vm_api``, ``vm_policy``.
- ``audit``: ``world(s).audit_ports`` (NVML with details, PVE, ``/proc``, node files), ``cluster_audits``, the textfile.
- ``gpu-reset N``: ``gpu_reset_ports`` (the world's, ``nvidia-smi``, the containers' reset locks, the gate), ``gpu_lock``.
- ``hook install | uninstall | status``: ``install_target`` (``/etc/pve``, node name, snippet lister, ``pct``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from pvegpu.adapters import drain, etcpve, journal, locks, nodefiles, storagecfg
from pvegpu.adapters.bounded import BoundedProbe
from pvegpu.adapters.clock import SystemClock as system_clock
from pvegpu.adapters.etcpve import EtcPve, NodePve, no_pve
from pvegpu.adapters.kernlog import KMSG, KmsgLog
from pvegpu.adapters.nvml import NvmlProbe
from pvegpu.adapters.override import allow_once, withdraw
from pvegpu.adapters.procfs import ProcHost, ScanBudget
from pvegpu.adapters.pvecli import run_command
from pvegpu.adapters.settingsfile import load
from pvegpu.adapters.users import user_name
from pvegpu.core import errors as E
from pvegpu.core.ha import HaFiles
from pvegpu.core.leftover import LeftoverRule
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.model import MIB, Guest
from pvegpu.core.ports import EventLog, GpuProbe, Host, KernelLog, NodeFiles, NullLog, PveApi, PveReader, WallClock
from pvegpu.core.settings import Settings
from pvegpu.gate.decide import GatePolicy, GatePorts, evaluate, paragraph
from pvegpu.sim.state import SimState
from pvegpu.sim.trust import node_settings

if TYPE_CHECKING:
    from pvegpu.adapters.pve import ProxmoxerPve
    from pvegpu.adapters.ssh import SshAudits
    from pvegpu.gpureset import GpuResetPolicy, GpuResetPorts
    from pvegpu.reset.report import Ports, ResetPolicy
    from pvegpu.vm.guest import VmApi
    from pvegpu.vm.reset import VmPolicy

# The hookscript's pre-start runs on every guest start and imports only the gate's wiring: the reset, VM, gpu-reset and
# simulated-node modules are imported by the functions that build them (``docs/gate.md``, the gate's budget).


@dataclasses.dataclass(frozen=True)
class GlobalOptions:
    """The global options (``--config``, ``--simulate``), given before the command."""

    config: str | None = None
    simulate: str | None = None


def settings(opts: GlobalOptions, overrides: Mapping[str, object] | None = None) -> Settings:
    """Settings from ``--config`` (or PVEGPU_CONFIG, or /etc/pvegpu/pvegpu.toml), PVEGPU_* and flag overrides. A simulated node
    (only its owner may use it) adds its scenario's settings and keeps its state (any ``*_dir``) in its own directory, with no settings snapshot."""
    sim = opts.simulate or os.environ.get("PVEGPU_SIMULATE")
    extra = node_settings(sim, overrides or {}, named=f"--simulate {sim}" if opts.simulate else f"PVEGPU_SIMULATE={sim}")
    extra |= {"simulate": opts.simulate} if opts.simulate else {}
    s = load(opts.config, overrides=extra, **({"snapshot_dir": None} if opts.simulate else {}))
    if not s.simulate:
        return s
    from pvegpu.sim import scenario  # a simulated node only

    return scenario.own_state(s)


# -- policies: every default comes from settings.py ------------------------------------------------------
def leftover_rule(s: Settings) -> LeftoverRule:
    """``[leftover]``: the one rule reset's verify, the gate, audit and the diagnosis judge leftover memory by."""
    return LeftoverRule(s.leftover.threshold_mib * MIB, int(s.leftover.per_context_mib * MIB))


def reset_policy(s: Settings, *, dry_run: bool = False) -> ResetPolicy:
    """``[reset]`` as the state machine's policy."""
    from pvegpu.reset.report import ResetPolicy  # not on the hook's pre-start path

    r, rule = s.reset, leftover_rule(s)
    return ResetPolicy(grace=r.grace, kill_wait=r.kill_wait, timeout=r.timeout, poll=r.poll, settle=r.settle, rounds=r.rounds,
                       threshold_bytes=rule.threshold_bytes, per_context_bytes=rule.per_context_bytes, restart=r.restart, dry_run=dry_run, task_timeout=r.task_timeout)


def post_stop_policy(s: Settings) -> ResetPolicy:
    """The post-stop reclaim: the reset policy, never restarting, with short waits (PVE waits for the hook)."""
    p = reset_policy(s)
    return dataclasses.replace(p, restart=False, grace=min(p.grace, 2.0), timeout=max(min(p.timeout, 2.0), p.settle + p.poll))


def gate_policy(s: Settings) -> GatePolicy:
    """``[gate]`` as the start gate's policy."""
    return GatePolicy(leftover_rule(s), s.gate.on_unknown, frozenset(s.gate.exclusive), s.gate.exclusive_tag, s.gate.host_users, s.gate.health)


def vm_policy(s: Settings, *, dry_run: bool = False) -> VmPolicy:
    """``[reset]`` as the VM reset's policy (each guest command bounded by the poll-independent exec deadline)."""
    from pvegpu.vm.reset import VmPolicy  # not on the hook's pre-start path

    r = s.reset
    return VmPolicy(grace=r.grace, kill_wait=r.kill_wait, timeout=r.timeout, settle=r.settle, restart=r.restart, dry_run=dry_run,
                    task_timeout=r.task_timeout, exec_timeout=max(2.0, min(30.0, r.timeout)),
                    shutdown_timeout=max(1, int(min(60.0, r.task_timeout / 2))), poll=max(r.poll, 0.2), rounds=r.rounds)


def read_deadline(s: Settings) -> float:
    """How long one GPU reading may take before it is abandoned as unknown (NVML stuck in the driver)."""
    return max(0.2, min(2.0, s.reset.timeout / 2))


# -- NVML, opened one way for every command ---------------------------------------------------------------------
def nvml_reader(s: Settings, *, details: bool = False, sim: GpuProbe | None = None, deadline: float | None = None) -> BoundedProbe:
    """NVML for one run (``sim``: the simulated node's; ``details``: bus ids, totals, health), opened and read in a thread,
    each step within ``deadline``. ``close()`` it: a resident NVML client blocks ``nvidia-smi -r`` and is a holder."""
    opener: Callable[[], GpuProbe] = (lambda: sim) if sim is not None else (lambda: NvmlProbe(details=details))
    return BoundedProbe(None, read_deadline(s) if deadline is None else deadline, opener=opener)


# -- the start gate: /etc/pve, NVML, /proc; never the API -----------------------------------------------------
def gate_pve(s: Settings) -> PveReader:
    """Where the gate finds a guest: this node's ``/etc/pve`` (or the simulated node's PVE)."""
    if s.simulate:
        return _sim_ports(s)[0]
    if not EtcPve.present(s.pve_root):
        raise no_pve(s.pve_root)
    return EtcPve(s.pve_root, node=s.node, local_first=True)


def gate_ports(s: Settings) -> GatePorts:
    """NVML's opening begins now, beside the config and ``/proc`` reads; its readings get ``gate.deadline``, the forked
    check's own (``hook.collect``: NVML stuck is its timeout, exit 5), each of the (at most two) scans under a third."""
    pve: PveReader
    if s.simulate:
        pve, sim, host = _sim_ports(s)
    else:
        pve, sim, host = gate_pve(s), None, ProcHost(budget=ScanBudget(total=s.gate.deadline * 0.3), record_dir=s.gate.record_dir)
    probe = nvml_reader(s, details=True, sim=sim, deadline=s.gate.deadline)  # details: bus ids, to match the kernel log's Xids
    probe.begin()
    return GatePorts(pve, probe, host, lambda vmid: locks.reset_running(s.reset.lock_dir, vmid),
                     kernlog=kernel_log(s, s.gate.deadline * 0.2), draining=lambda m: gpu_draining(s, m))


def kernel_log(s: Settings, deadline: float = 1.0) -> KmsgLog:
    """The kernel log's Xids and GPU resets (``/dev/kmsg``; the simulated node's ``kmsg`` file), read within ``deadline``."""
    if s.simulate:
        return KmsgLog(os.path.join(s.simulate, "kmsg"), deadline=min(1.0, deadline), nf_log_all_netns=os.path.join(s.simulate, "nf_log_all_netns"))
    return KmsgLog(KMSG, deadline=min(1.0, deadline))


def gpu_draining(s: Settings, minor: int) -> str | None:
    """The mark of a ``pvegpu gpu-reset`` of GPU minor ``minor`` running now (the gate and reset refuse), or None."""
    return drain.draining(s.gpureset.drain_dir, minor)


def gate_files(s: Settings) -> NodeFiles:
    """The node's files the VM gate reads: VM configs and ``mapping/pci.cfg`` in ``/etc/pve``, PCI drivers in sysfs."""
    if not s.simulate:
        return nodefiles.LocalNodeFiles(s.pve_root)
    from pvegpu.sim import nodefiles as simfiles  # a simulated node only

    return simfiles.SimNodeFiles(s.simulate)


def own_start(s: Settings, vmid: int) -> str | None:
    """The reset whose own restart of CT ``vmid`` is starting it now ('pid N'), or None (the gate's lock check)."""
    return locks.own_start(s.reset.lock_dir, vmid)


def _sim_ports(s: Settings) -> tuple[PveApi, GpuProbe, Host]:
    from pvegpu.sim import scenario  # a simulated node only

    return scenario.SimNode(s.simulate).ports(s.gate.record_dir)  # the gate's and audit's record of listed pids, as on a node


# -- reset and audit: one node world per run ------------------------------------------------------------------
def resolve_backend(s: Settings) -> str | None:
    """local (pvesh as root on a node), https, or None when no API can be used."""
    if s.api.backend != "auto":
        return s.api.backend
    return "https" if s.api.host else "local" if EtcPve.present(s.pve_root) and os.geteuid() == 0 else None


def api_client(s: Settings, node: str = "") -> ProxmoxerPve | None:
    """A ProxmoxerPve for the configured backend, or None; connects on the first call that needs it (pvesh runs
    stop/start synchronously: those get the task deadline, every read api.timeout)."""
    backend = resolve_backend(s)
    if backend is None:
        return None
    from pvegpu.adapters.pve import ProxmoxerPve, connect  # proxmoxer, requests: never on the hookscript's path

    return ProxmoxerPve(connect(s.api, backend, task_timeout=s.reset.task_timeout), node=node)


def pve_port(s: Settings) -> PveApi:
    """The PveApi: ``/etc/pve`` reads on the node, the API for power actions (and for reads off the node)."""
    if s.simulate:
        return _sim_ports(s)[0]
    local = EtcPve(s.pve_root, node=s.node, local_first=True) if EtcPve.present(s.pve_root) else None  # where(): no .vmlist json
    has_api = resolve_backend(s) is not None
    if local is None and not has_api:
        raise no_pve(s.pve_root)
    node = s.node or (local.local_node() if local else "") or ""
    return NodePve(local, (lambda: api_client(s, node)) if has_api else None)


PROC_SCAN_TOTAL = 15.0  # seconds one process scan of reset/audit may take (audit's unit allows 50 s in all)
_AHEAD: list[Host] = []  # this node's host, its whole-node scan already started (``scan_ahead``), for ``world``


def proc_host() -> Host:
    """``/proc``, cgroupfs and pidfd signals of this node: the one ``scan_ahead`` started, else a new one."""
    return _AHEAD.pop() if _AHEAD else ProcHost(budget=ScanBudget(total=PROC_SCAN_TOTAL))


def scan_ahead(opts: GlobalOptions) -> None:
    """``pvegpu audit`` of this node: its whole-node scan starts now (``ProcHost.prefetch``), before the settings, NVML
    and the configs are read; ``world`` takes this host (or, for a simulated node, ends it); then ``end_scan_ahead()``."""
    if opts.simulate or _AHEAD:
        return
    host = proc_host()
    if (prefetch := getattr(host, "prefetch", None)) is not None:
        prefetch(deep=True)  # as the audit's whole-host reading scans (``inspect_gpus``)
    _AHEAD.append(host)


def end_scan_ahead() -> None:
    """End a scan ``scan_ahead`` started that no command took (the settings failed, or named a simulated node)."""
    while _AHEAD:
        if (cancel := getattr(_AHEAD.pop(), "cancel_prefetch", None)) is not None:
            cancel()


@dataclasses.dataclass
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
    kernlog: KernelLog | None = None  # the kernel log's Xids and GPU resets (health)


@dataclasses.dataclass
class NodeWorld:
    """One node, simulated or this one, chosen once (``world(s)``): the ports every command of the run shares."""

    settings: Settings
    simulated: bool
    pve: PveApi
    host: Host
    files: NodeFiles
    clock: WallClock
    reset_probe: BoundedProbe  # reset's NVML, one per run: opened at its first reading, or begun by ``warm_up``
    audit_probe: Callable[[], GpuProbe]  # a reader with details for each audit run, opened by the call

    def warm_up(self) -> None:
        """Begin opening reset's NVML now (the guest is a container), beside the lock and ``/etc/pve`` reads."""
        if not self.simulated:
            self.reset_probe.begin()

    @contextlib.contextmanager
    def reset_ports(self, log: EventLog | None = None, *, exiting: bool = False) -> Iterator[Ports]:
        """Ports for ``pvegpu reset`` and the post-stop reclaim; NVML is closed when the ``with`` ends (``exiting``: the
        process ends right after, so in a daemon thread, not waited for)."""
        from pvegpu.reset.report import Ports  # not on the hook's pre-start path

        try:
            yield Ports(self.pve, self.reset_probe, self.host, self.clock, log or NullLog(), kernlog=kernel_log(self.settings))
        finally:
            if exiting and not self.simulated:
                threading.Thread(target=self.reset_probe.close, name="pvegpu-close", daemon=True).start()
            elif not self.simulated:
                self.reset_probe.close()

    def audit_ports(self, *, scan_ahead: bool = False) -> AuditPorts:
        """Ports for ``pvegpu audit`` (NVML opened for the run only). ``scan_ahead``: the whole-node scan starts now in
        forked workers (``ProcHost.prefetch``) while NVML and the configs are read; ``done()`` after the run."""
        prefetch, cancel = getattr(self.host, "prefetch", None), getattr(self.host, "cancel_prefetch", None)
        ports = AuditPorts(self.audit_probe, self.pve, self.host, self.files, leftover_rule(self.settings), self.clock, user_name,
                           kernlog=kernel_log(self.settings))
        if scan_ahead and prefetch is not None and cancel is not None:
            prefetch()
            ports.done = cancel
        return ports


def world(s: Settings) -> NodeWorld:
    """The simulated node under ``s.simulate``, else this node."""
    if s.simulate:
        end_scan_ahead()  # a scan of this node started before the settings named a simulated one
        from pvegpu.sim import nodefiles as simfiles  # a simulated node only

        pve, sim, host = _sim_ports(s)
        files: NodeFiles = simfiles.SimNodeFiles(s.simulate)
    else:
        pve, sim, host, files = pve_port(s), None, proc_host(), nodefiles.LocalNodeFiles(s.pve_root)
        if isinstance(host, ProcHost):  # the gate's and audit's record of NVML-listed pids, kept between runs
            host.record_dir = s.gate.record_dir

    def audit_probe() -> GpuProbe:
        probe = nvml_reader(s, details=True, sim=sim)
        probe.start()  # NVML that cannot start is a GpuQueryError here: the audit reports it and still checks the configs
        return probe

    return NodeWorld(s, sim is not None, pve, host, files, system_clock(), nvml_reader(s, details=True, sim=sim), audit_probe)


journal_line = journal.log_line  # one line to the system log with ident pvegpu (``journalctl -t pvegpu``)


def system_log(s: Settings) -> Callable[[str], bool]:
    """Where the gate's lines for the system log go: ``journal_line``, or a simulated node's own ``journal.log``."""
    return SimState(s.simulate).log_line if s.simulate else journal_line


def ha_files(s: Settings) -> HaFiles:
    """The HA files (``/etc/pve/ha/*.cfg``) of this node, or of the simulated node."""
    return etcpve.ha_files(SimState(s.simulate).etc_pve if s.simulate else s.pve_root)


def write_textfile(path: str, doc: Mapping[str, object]) -> None:
    """``audit --prometheus PATH``: node_exporter's textfile, written safely."""
    from pvegpu.adapters.textfile import write_textfile as write  # prometheus_client: never on the hookscript's path

    write(path, doc)


def ct_lock(s: Settings, vmid: int, wait: float, on_wait: Callable[[str], None] | None = None, kind: str = "CT") -> locks.ct_lock:
    """The guest's reset lock (``/run/pvegpu/locks/<vmid>.lock``); ``on_wait(text)`` hears of a wait once a second."""
    return locks.ct_lock(s.reset.lock_dir, vmid, wait, on_wait, kind)


def vm_api(s: Settings) -> VmApi:
    """The VM reset's API (config, status, power, guest agent exec): https with a token, or pvesh on the node."""
    node = s.node or (EtcPve(s.pve_root, node=s.node).local_node() if EtcPve.present(s.pve_root) else "") or ""
    api = None if s.simulate else api_client(s, node)
    if api is None:
        raise E.UsageError("a VM reset works through the Proxmox API and its guest agent, and none can be used here",
                           "run it as root on a PVE node (pvesh), or set api.host and an API token (README 'VMs')")
    from pvegpu.adapters.agent import ProxmoxerVm  # proxmoxer, requests: never on the hookscript's path

    return ProxmoxerVm(api)


def cluster_audits(timeout: float, options: list[str]) -> SshAudits:
    """The other nodes' audits, over the root SSH trust PVE sets up between cluster nodes."""
    from pvegpu.adapters.ssh import SshAudits  # concurrent.futures brings logging: not on a reset's or the hook's path

    return SshAudits(timeout=timeout, options=options)


# -- gpu-reset N ------------------------------------------------------------------------------------------------
def ct_draining(s: Settings, pve: PveReader, guest: Guest) -> str | None:
    """The mark of a gpu-reset of one of the container's GPUs (``pvegpu reset`` refuses while it runs), or None."""
    try:
        gpus = parse_config(pve.ct_config(guest)).gpus
    except E.PvegpuError:
        return None  # the reset itself says why the config cannot be read
    return drain.draining_any(s.gpureset.drain_dir, None if gpus.all_gpus else gpus.minors)


def gpu_reset_policy(s: Settings, *, dry_run: bool = False) -> GpuResetPolicy:
    """``[gpureset]`` and the reset's API waits."""
    from pvegpu.gpureset import GpuResetPolicy  # not on the hook's pre-start path

    g = s.gpureset
    return GpuResetPolicy(reset_policy(s), g.idle_mib * MIB, g.client_wait, s.reset.timeout, dry_run=dry_run)


def gpu_reset_ports(s: Settings, w: NodeWorld) -> GpuResetPorts:
    """The world's PVE, NVML, ``/proc`` and files; ``nvidia-smi`` (a simulated node: its stand-in, always); each stopped
    container's reset lock; the start gate as ``check`` decides (our own locks are ours: not held against the start)."""
    from pvegpu.adapters.smi import SmiControl  # not on the hook's pre-start path
    from pvegpu.gpureset import GpuResetPorts
    from pvegpu.sim.smi import SimSmi

    control = SimSmi(s.simulate, s.gpureset.smi_timeout) if s.simulate else SmiControl(s.gpureset.smi, s.gpureset.smi_timeout)

    def gate(vmid: int, waive_health: bool) -> tuple[bool, str]:
        ports = dataclasses.replace(gate_ports(s), reset_running=None)
        policy = dataclasses.replace(gate_policy(s), health="warn") if waive_health else gate_policy(s)
        try:
            d = evaluate(vmid, ports, policy).decision
        finally:
            getattr(ports.probe, "close", lambda: None)()
        return d.allow, paragraph(vmid, d)

    return GpuResetPorts(w.pve, w.reset_probe, w.host, w.clock, control, w.files, lambda vmid, on_wait: ct_lock(s, vmid, s.reset.lock_wait, on_wait),
                         gate, w.reset_probe.close, kernlog=kernel_log(s), allow_once=lambda vmid: _once(s, vmid))


def _once(s: Settings, vmid: int) -> Callable[[], object]:
    """CT ``vmid``'s one-start token, and the call that withdraws exactly that token (never one written since)."""
    token = allow_once(s.gate.override_dir, vmid)
    return lambda: withdraw(s.gate.override_dir, token)


def gpu_lock(s: Settings, minor: int, label: str) -> drain.gpu_lock:
    """One gpu-reset per GPU (``<gpureset.drain_dir>/gpu<minor>.lock``); ``drain()`` marks it for the gate."""
    return drain.gpu_lock(s.gpureset.drain_dir, minor, label)


# -- hook install | uninstall | status ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InstallTarget:
    """Where ``hook install | uninstall | status`` act: ``/etc/pve``, node name, snippet lister (None: unknown), ``pct``."""

    pve_root: str
    node: str
    lister: Callable[[str], set[str] | None] | None
    run: Callable[[list[str]], tuple[int, str]]


def install_target(s: Settings, storage: str, *, need_root: bool) -> InstallTarget:
    """This node (real ``pct``), or a simulated node's own files (never this node's ``/etc/pve`` or ``/var/lib/vz``)."""
    if s.simulate:
        from pvegpu.sim import scenario  # a simulated node only
        from pvegpu.sim.pvecli import SimPveCli

        sim = scenario.SimNode(s.simulate)
        where, root = os.path.realpath(storagecfg.read_storage(sim.state.etc_pve, storage).path), os.path.realpath(sim.root)
        if os.path.commonpath([where, root]) != root:
            raise E.UsageError(f"--simulate {s.simulate}: storage {storage} is {where}, outside the simulated node",
                               "a simulated node's storages live in its own directory; rebuild it with `pvegpu sim create DIR`")
        return InstallTarget(sim.state.etc_pve, sim.node, None, SimPveCli(sim.root, sim.node))
    if need_root and os.geteuid() != 0:
        raise E.UsageError("installing the guard needs root on the node", "`pct set --hookscript` is allowed for root@pam only; run it as root")
    if not EtcPve.present(s.pve_root):
        raise no_pve(s.pve_root)
    name = EtcPve(s.pve_root, node=s.node).local_node() or ""
    try:
        api = api_client(s, name)
    except E.PvegpuError:
        api = None

    def lister(n: str) -> set[str] | None:
        try:
            return set(api.snippets(n, storage)) if api is not None else None
        except E.PvegpuError:
            return None

    return InstallTarget(s.pve_root, name, lister if api is not None else None, run_command)
