"""``pvegpu audit``: which guest holds which GPU, right now and by configuration, with advice.

Runtime (this node only, NVML is per node): every NVML-listed pid and every ``/dev/nvidia*`` holder,
placed by cgroup, with NVML's memory per process. Configuration: the ``devN``/``lxc.*`` grants of each
container, the ``hostpciN`` entries of each VM (``mapping=`` resolved for this node) and the driver the
host has bound to those PCI devices. Manual equivalent: ``nvidia-smi`` + ``fuser -v /dev/nvidia*`` +
``grep -e nvidia -e hostpci /etc/pve/nodes/*/{lxc,qemu-server}/*.conf`` + ``lspci -k``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from pvegpu.audit.guests import GuestScan, scan_guests
from pvegpu.audit.model import Flag, FlagKind, GpuRow, HolderRow, NodeAudit, document
from pvegpu.core.driver import DriverCheck, DriverMatch
from pvegpu.core.errors import PvegpuError
from pvegpu.core.holders import GpuFacts, inspect_gpus
from pvegpu.core.leftover import LeftoverRule, gpu_reset_advice, gpu_users, leftover, users_text
from pvegpu.core.model import GpuHealth, GpuInfo, GpuSample, Holder, Place, Via
from pvegpu.core.ports import Clock, GpuProbe, Host, KernelLog, NodeFiles, PveApi, WallClock
from pvegpu.core.qemuconf import same_device
from pvegpu.core.units import mib_figure
from pvegpu.health import State, judge, xid_text

DEFAULT_THRESHOLD = LeftoverRule()  # the one leftover rule's defaults (``[leftover]``)


def run_audit(*, pve: PveApi, probe: GpuProbe | None, host: Host | None, files: NodeFiles | None = None,
              cluster: bool = False, threshold_bytes: LeftoverRule | int = DEFAULT_THRESHOLD, probe_error: str | None = None,
              clock: Clock | None = None, users: Callable[[int], str | None] | None = None,
              kernlog: KernelLog | None = None) -> NodeAudit:
    """The audit of this node; one unreadable GPU or config never hides the others.

    ``probe`` None with ``probe_error``: NVML could not start (driver not loaded yet): an error, the configs still checked.
    ``cluster``: list other nodes' guests too (their runtime comes from their own audit, see ``audit_cluster``).
    ``threshold_bytes``: the leftover rule (a plain number: the threshold with the default per-context allowance).
    ``clock``: times the run (``duration_seconds``; 0 without one).
    ``users``: the host's user name of a uid (an adapter), for the holder rows.
    ``kernlog``: the kernel log's Xids and GPU resets, for each GPU's health verdict (None: not read, unknown).
    """
    rule = threshold_bytes if isinstance(threshold_bytes, LeftoverRule) else replace(LeftoverRule(), threshold_bytes=threshold_bytes)
    started = clock.monotonic() if clock is not None else 0.0
    node = pve.local_node() or ""
    rep = NodeAudit(node)
    scan = scan_guests(pve, host, files, node, cluster=cluster)
    rep.guests, rep.passthrough = scan.guests, scan.passthrough
    rep.flags.extend(scan.flags)
    if host is not None and files is not None:
        _drivers(rep, host, files)
    if probe is None or host is None:
        rep.error = probe_error or "GPUs not read"
        rep.flags.append(Flag(FlagKind.UNREADABLE, "all GPUs", rep.error))
    else:
        _runtime(rep, probe, host, scan, rule, users, kernlog)
    rep.duration_seconds = round(clock.monotonic() - started, 4) if clock is not None else 0.0
    return rep


def _drivers(rep: NodeAudit, host: Host, files: NodeFiles) -> None:
    """Each running GPU container's NVIDIA libraries against the host's kernel module (``core.driver``): a mismatch is
    flagged with the fix; what cannot be read is unknown, never a mismatch."""
    running = [g for g in rep.guests if g.type == "lxc" and g.status == "running" and (g.minors or g.all_gpus)]
    if not running:
        return
    host_version = files.driver_version()
    for i, g in enumerate(rep.guests):
        if g not in running:
            continue
        init = host.ct_init(g.vmid)
        libs = None if init is None else files.ct_lib_versions(g.vmid, init)
        why = ("the host's /proc/driver/nvidia/version cannot be read" if host_version is None else
               "its init cannot be found" if init is None else "its root or a lib directory in it cannot be read in full" if libs is None else
               "no libnvidia-ml.so.<version> / libcuda.so.<version> in its lib directories" if not libs else None)
        check = DriverCheck(host_version, libs, why)
        rep.guests[i] = replace(g, driver=check)
        if check.state is DriverMatch.MISMATCH:
            rep.flags.append(Flag(FlagKind.DRIVER_MISMATCH, g.id, f"its NVIDIA libraries are {check.named()}, the host's "
                                  f"kernel module is {host_version}", check.fix(g.vmid)))


audit = run_audit  # the name the demo and older callers use


def audit_once(open_probe: Callable[[], GpuProbe], **ports: Any) -> NodeAudit:
    """One audit run with NVML open only for its duration (a resident client blocks ``nvidia-smi -r``)."""
    try:
        probe = open_probe()
    except PvegpuError as exc:
        return run_audit(probe=None, probe_error=exc.message, **ports)
    try:
        return run_audit(probe=probe, **ports)
    finally:
        close = getattr(probe, "close", None)
        if close is not None:
            close()


def audit_document(reports: Iterable[NodeAudit | Mapping[str, Any]], generated_at: float | None = None,
                   clock: WallClock | None = None) -> dict[str, Any]:
    """The versioned JSON document (``pvegpu audit --json``) for local audits and other nodes' JSON; ``generated_at``
    is given, or read from ``clock`` (0 with neither)."""
    nodes = [r.to_json() if isinstance(r, NodeAudit) else dict(r) for r in reports]
    if generated_at is None:
        generated_at = clock.time() if clock is not None else 0.0
    return document(nodes, generated_at)


def _runtime(rep: NodeAudit, probe: GpuProbe, host: Host, scan: GuestScan, threshold: LeftoverRule,
             users: Callable[[int], str | None] | None = None, kernlog: KernelLog | None = None) -> None:
    try:
        gpus = probe.gpus()
    except PvegpuError as exc:
        rep.error = f"GPUs of {rep.node or 'this node'} cannot be read: {exc.message}"
        rep.flags.append(Flag(FlagKind.UNREADABLE, "all GPUs", rep.error))
        return
    lost = dict(getattr(probe, "lost", {}))  # GPUs NVML could not name, by index (read now: later reads may redo gpus())
    ahead = _HealthAhead(probe)
    facts = inspect_gpus(None, gpus, host=host, probe=ahead, whole_host=True, remember=True)
    health_of = getattr(probe, "health", None)
    log = kernlog.events() if kernlog is not None and health_of is not None else None
    for gpu in gpus:
        row = _gpu_row(gpu, facts[gpu.minor], host.self_pid, scan, threshold, rep.flags)
        if users is not None:
            row.holders = [replace(h, user=users(h.uid)) if h.uid is not None else h for h in row.holders]
        if health_of is not None:  # a GPU whose memory read failed is judged too: a lost one fails both, its Xid 79 is logged
            read = ahead.read[gpu.minor] if gpu.minor in ahead.read else _health(health_of, gpu.minor)
            row.health = read if read is not None else GpuHealth()  # None: the reading failed, every fact unknown
            if read is None and row.error is None:  # its memory was read, its health was not: it may be the lost one
                row.flags.append(FlagKind.UNREADABLE)
                rep.flags.append(Flag(FlagKind.UNREADABLE, f"GPU {gpu.index}", f"{gpu.uuid}: NVML's health reading failed "
                                      "or did not come in time: whether it is lost or needs a reset is unknown"))
            _health_flags(row, rep.flags, facts[gpu.minor])
            row.verdict = judge(read, log, gpu.bus_id, gpu.uuid, str(gpu.index))
            _verdict_flags(row, rep.flags)
        rep.gpus.append(row)
    for index, why in sorted(lost.items()):  # NVML could not name it: an error row, never a gap
        rep.gpus.append(GpuRow(index, -1, "?", "?", "", error=why))
        rep.flags.append(Flag(FlagKind.UNREADABLE, f"GPU {index}", f"NVML index {index}: {why}"))
    rep.gpus.sort(key=lambda g: g.index)


class _HealthAhead:
    """The audit's probe for ``inspect_gpus``: each GPU whose memory was read has its health read right after (the
    node's scan still runs beside it), not after the scan; ``read`` keeps them for the GPU rows."""

    def __init__(self, inner: GpuProbe) -> None:
        self.inner = inner
        self.read: dict[int, GpuHealth | None] = {}  # None: that GPU's health reading failed

    def sample(self, minors: Iterable[int]) -> dict[int, GpuSample]:
        got = self.inner.sample(minors)
        known = [minor for minor, sample in got.items() if sample.known]  # a GPU whose reading failed gets no health row
        many = getattr(self.inner, "health_many", None)  # one bounded read for them all (``BoundedProbe``)
        health_of = getattr(self.inner, "health", None)
        if many is not None:
            read = many(known)
            self.read.update({minor: read.get(minor) for minor in known})
        elif health_of is not None:
            self.read.update({minor: _health(health_of, minor) for minor in known})
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _health(read: Callable[[int], GpuHealth], minor: int) -> GpuHealth | None:
    """That GPU's health, None when its reading failed (unknown, never healthy)."""
    try:
        return read(minor)
    except PvegpuError:
        return None


def _holder_row(h: Holder, used: int | None, hostnames: Mapping[int, str], inherited: tuple[int, int | None] | None = None,
                hidden: bool = False) -> HolderRow:
    p, info = h.info.placement, h.info
    place = {Place.CONTAINER: "lxc", Place.VM: "qemu", Place.MONITOR: "monitor", Place.HOST: "host"}.get(p.place, "unknown")
    hostname = hostnames.get(p.vmid) if p.vmid is not None and place in ("lxc", "qemu") else None
    ghost, credited = inherited if inherited is not None else (None, None)
    # NVML lists every live context's owner: an unlisted process that maps the device has no context NVML does not
    # show (a DataLoader worker shares its listed parent's), unless it keeps the context of a dead listed pid
    owns = Via.NVML in h.via or ghost is not None or (Via.MAPS in h.via and hidden)
    return HolderRow(h.pid, info.ns_pid, info.comm, info.cmdline, info.uid, place, p.vmid, hostname, used, tuple(sorted(h.via)),
                     credited, ghost, owns)


def _gpu_row(gpu: GpuInfo, f: GpuFacts, self_pid: int, scan: GuestScan, rule: LeftoverRule, flags: list[Flag]) -> GpuRow:
    subject = f"GPU {gpu.index}"
    used_by_pid = {p.pid: p.used_bytes for p in f.sample.processes or ()}
    inherited = {heir: (ghost, used_by_pid.get(ghost)) for ghost, heir in f.heirs.items()}  # credited as reset credits it
    lo = leftover(f, rule)
    row = GpuRow(gpu.index, gpu.minor, gpu.uuid, gpu.bus_id, gpu.name, gpu.total_bytes, f.used_bytes, lo.net_bytes,
                 lo.residual_bytes, lo.allowance_bytes, lo.contexts_outside, rule.threshold_bytes,
                 error=f.sample.error if not f.sample.known else None)
    hidden = bool(f.unexplained_ghosts)  # a dead listed pid no heir explains: an unlisted mapper may be keeping it
    row.holders = [_holder_row(h, used_by_pid.get(h.pid), scan.hostnames, inherited.get(h.pid), hidden)
                   for h in f.other_holders if h.pid != self_pid]
    row.dead_pids = list(f.ghosts)
    row.granted_to = sorted({g.id for g in scan.guests if g.type == "lxc" and g.node == scan.node
                             and (gpu.minor in g.minors or g.all_gpus)}
                            | {g.id for g in scan.guests if g.type == "qemu" and any(same_device(b, gpu.bus_id) for b in g.bus_ids)})

    def flag(kind: FlagKind, detail: str, advice: str | None = None) -> None:
        if kind not in row.flags:
            row.flags.append(kind)
        flags.append(Flag(kind, subject, detail, advice))

    vms, cts = [g for g in row.granted_to if g.startswith("qemu/")], [g for g in row.granted_to if g.startswith("lxc/")]
    if vms and cts:  # the VM's start unbinds it from nvidia under the containers (pvegpu/gate/vm.py refuses that start)
        flag(FlagKind.VM_AND_CT, f"granted to {', '.join(vms)} (passthrough) and to {', '.join(cts)}")
    if row.error is not None:
        flag(FlagKind.UNREADABLE, f"{gpu.uuid}: {row.error}")
        return row
    for pid in row.dead_pids:
        heir = f.heirs.get(pid)
        whose = f"its context is kept by pid {heir}, credited with its memory" if heir is not None else \
            "no process is proven to keep it (a fork child in its process group or session): unexplained"
        flag(FlagKind.DEAD_PID, f"NVML lists pid {pid} on /dev/nvidia{gpu.minor}; it no longer exists; {whose}")
    if lo.over and row.unattributed_bytes is not None:
        flag(FlagKind.UNATTRIBUTED, f"{mib_figure(row.unattributed_bytes)} MiB used that no live process accounts for "
                                    f"(after {mib_figure(lo.allowance_bytes)} MiB allowed for {lo.contexts_outside} context(s))",
             gpu_reset_advice(f))
    elif row.unattributed_bytes is None:
        flag(FlagKind.USAGE_UNKNOWN, "a process's memory is not reported: leftovers cannot be measured")
    guests = sorted({h.guest_id for h in row.holders if h.place == "lxc" and h.guest_id})
    if len(guests) > 1:
        flag(FlagKind.SHARED, f"held by {', '.join(guests)}")
    for h in row.holders:
        if h.place in ("host", "monitor") and not context_capable(h):  # an NVML client: information, not attention
            flag(FlagKind.NVML_CLIENT, f"pid {h.pid} ({h.comm}) on the {h.place} has /dev/nvidia{gpu.minor} open, not listed by NVML")
        elif h.place in ("host", "monitor"):
            flag(FlagKind.HOST_HOLDER, f"pid {h.pid} ({h.comm}) on the {h.place} holds /dev/nvidia{gpu.minor}")
        elif h.place == "unknown":
            flag(FlagKind.UNKNOWN_PLACE, f"pid {h.pid} ({h.comm}): placement unknown")
    return row


def context_capable(h: HolderRow) -> bool:
    """It may own a CUDA context and memory (``HolderRow.may_own_context``); otherwise it is an NVML client."""
    return h.may_own_context


def _health_flags(row: GpuRow, flags: list[Flag], f: GpuFacts) -> None:
    h = row.health
    what = [name for name, v in (("row remapping pending", h.remap_pending), ("row remapping failed", h.remap_failed),
                                 ("retired pages pending", h.retired_pages_pending)) if v]
    if what:
        users = gpu_users(f)
        when = (f"only once it is no longer in use by {users_text(users)} (a GPU reset would end their work)" if users
                else f"no process uses it now: `pvegpu gpu-reset {row.index}`")
        row.flags.append(FlagKind.HEALTH)
        flags.append(Flag(FlagKind.HEALTH, f"GPU {row.index}", f"{row.uuid}: {', '.join(what)}",
                          f"a reset is pending for row remapping / page retirement: {when}"))


_VERDICT_FLAGS = {State.NEEDS_RESET: FlagKind.NEEDS_RESET, State.NEEDS_REBOOT: FlagKind.NEEDS_REBOOT, State.LOST: FlagKind.GPU_LOST}


def _verdict_flags(row: GpuRow, flags: list[Flag]) -> None:
    """The health verdict as flags, naming the guests on the GPU (granted it, or holding it now)."""
    v = row.verdict
    if v is None:
        return
    guests = sorted(set(row.granted_to) | {h.guest_id for h in row.holders if h.guest_id})
    on = f"; guests on it: {', '.join(guests)}" if guests else "; no guest is granted it"
    subject = f"GPU {row.index}"
    logged = v.xids + v.app_xids
    if logged:
        row.flags.append(FlagKind.XID)
        flags.append(Flag(FlagKind.XID, subject, f"{row.uuid}: " + ", ".join(xid_text(x) for x in logged[-5:]) + on))
    if (kind := _VERDICT_FLAGS.get(v.state)) is not None:
        row.flags.append(kind)
        flags.append(Flag(kind, subject, f"{row.uuid}: {v.reason}{on}", f"{v.action}; the gate refuses starts onto it meanwhile"))
